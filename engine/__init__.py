"""dsv4-pd engine. Importing it asks MKL for strict conditional numerical reproducibility
(``MKL_CBWR=AUTO,STRICT``, read at MKL's first call; a user's own setting wins): on AVX-512
CPUs MKL's default sgemm picks kernels by row count, so a row's bits would depend on the batch.
It also tells glibc's malloc to keep freed host memory for reuse (``engine.host_malloc``; what
was done is ``HOST_MALLOC``): a CPU step's thousands of short-lived tensors otherwise page-fault in
afresh."""
import os

from engine import host_malloc

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
HOST_MALLOC = host_malloc.tune()
