"""Random JSON schemas for structured-output tests and benchmarks: nested objects, arrays, enums,
required fields, bounded integers and strings, string formats (uuid, ipv4).

Every value is bounded (``maxLength``, ``maximum``, ``maxItems``, enums, fixed-length formats,
``additionalProperties: false``), so a grammar-constrained random model, which would otherwise
write a string or a number forever, ends every sample well within a few hundred tokens."""
from __future__ import annotations

import random

# bounded ones deepseek-recipe accepts (it knows email, hostname, ipv4, ipv6, uuid). xgrammar's ipv4
# (and ipv6's embedded ipv4) admits leading zeros ("047.1.2.3"), as RFC 2673's dotted-quad does;
# Python's ipaddress refuses them.
FORMATS = ("uuid", "ipv4")
_WORDS = ("red", "green", "blue", "cyan", "amber", "teal")


def _value(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(("enum", "int", "bool", "str", "format", "array") + (("object",) if depth < 2 else ()))
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(_WORDS, 3)}
    if kind == "int":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "bool":
        return {"type": "boolean"}
    if kind == "str":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(1, 8)}
    if kind == "format":
        return {"type": "string", "format": rng.choice(FORMATS)}
    if kind == "array":
        items = rng.choice(({"type": "string", "enum": rng.sample(_WORDS, 2)},
                            {"type": "integer", "minimum": 0, "maximum": 99}))
        return {"type": "array", "items": items, "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    return random_schema(rng, depth + 1)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema with 2-3 properties (some required), nested up to 2 levels below."""
    props = {f"{'choice' if 'enum' in v else v['type']}{i}": v for i in range(rng.randint(2, 3))
             for v in [_value(rng, depth)]}
    required = sorted(rng.sample(sorted(props), rng.randint(1, len(props))))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schemas(n: int, seed: int = 0) -> list[dict]:
    """``n`` random schemas (deterministic for ``seed``)."""
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(n)]
