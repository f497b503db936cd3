"""The n-gram hash's constants, derived from the config alone: per-position multipliers, prime head sizes, offsets.

`model.ngram.NGramEmbedding` hashes with them (and holds them as the buffers `layer_multipliers`,
`ngram_heads_vocab_sizes`, `ngram_heads_offsets`, which the official checkpoint layout stores); checkpoint
conversion writes them without building a model.
"""

from __future__ import annotations

import math

from flashnext.config import TextConfig

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_LAYER_STRIDE = 10007


def _splitmix64(x: int) -> int:
    x = (x + _GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return (x ^ (x >> 31)) & _MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """Odd per-position hash multipliers, bounded so `token * m` stays below 2**63."""
    half = max(1, (((1 << 63) - 1) // max(vocab_size, 1)) // 2)
    base = seed + _LAYER_STRIDE * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (j + 1)) & _MASK64) % half) + 1 for j in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_vocab_sizes(base: int, first_head: int, count: int) -> list[int]:
    """Primes number `first_head + 1 ... first_head + count` strictly above `base - 1`."""
    sizes, p, found = [], base - 1, 0
    while len(sizes) < count:
        p += 1
        if _is_prime(p):
            found += 1
            if found > first_head:
                sizes.append(p)
    return sizes


def hash_constants(cfg: TextConfig, ple_index: int) -> tuple[list[int], list[int], list[int]]:
    """(multipliers [ngram_size], head table sizes [ngram_heads], head row offsets [ngram_heads]) of the
    `ple_index`-th PLE layer (counted over the PLE layers; head sizes are primes counted across them)."""
    heads = cfg.ngram_heads
    mults = layer_multipliers(cfg.vocab_size, cfg.ngram_size, ple_index, cfg.seed)
    sizes = head_vocab_sizes(cfg.ngram_vocab_size_base, ple_index * heads, heads)
    return mults, sizes, [sum(sizes[:i]) for i in range(heads)]
