"""dsv4-pd engine. Importing it asks MKL for strict conditional numerical reproducibility
(``MKL_CBWR=AUTO,STRICT``, read at MKL's first call; a user's own setting wins): on AVX-512
CPUs MKL's default sgemm picks kernels by row count, so a row's bits would depend on the batch."""
import os

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
