"""The token fingerprint a `KDAHybridCache` keeps: what lets `generate()` refuse a cache that does not hold the
start of the `input_ids` it is given (docs/architecture.md §8). `TokenFingerprint` is the cache's whole state
machine for it (extend, compare, roll back on crop, follow batch reordering); `extend_fingerprint` the hash.

Two 31-bit polynomial hashes per row, 16 bytes per sequence whatever the context length:

    h = extend_fingerprint(torch.zeros(B, 2, dtype=torch.int64), ids)   # [B, 2] for ids [B, T]
    extend_fingerprint(extend_fingerprint(h0, a), b) == extend_fingerprint(h0, torch.cat((a, b), 1))
"""

from __future__ import annotations

import torch

# Fingerprint: h(ids) = sum_i (ids_i + 1) * base^(T-1-i) mod p, for two primes below 2^31, so every product of two
# residues (< 2^62) fits int64. Two independent moduli: a chance collision of two different prefixes is ~1 in 2^62.
_HASH_MODULI = (2**31 - 1, 2**31 - 19)
_HASH_BASES = (1_000_003, 999_999_937)
# Tokens hashed per vectorised step: the [B, chunk, 2] int64 temporary stays at 1 MiB per row, and each sum of
# chunk residues (< 2^31 each) stays far below 2^63.
_HASH_CHUNK = 65536


_HASH_CONSTANTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _hash_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(moduli, bases) as int64 [2] tensors on `device`, made once per device: a decode step then hashes its
    token in three small ops, with no host-to-device copy."""
    if device not in _HASH_CONSTANTS:
        _HASH_CONSTANTS[device] = (torch.tensor(_HASH_MODULI, dtype=torch.int64, device=device),
                                   torch.tensor(_HASH_BASES, dtype=torch.int64, device=device))
    return _HASH_CONSTANTS[device]


def extend_fingerprint(h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Fingerprint of (the tokens behind `h`) followed by `ids`. h: [B, 2] int64, ids: [B, T] integer -> [B, 2]."""
    mod, base = _hash_constants(ids.device)
    h = h.to(ids.device)
    if ids.shape[1] == 1:  # decode step: h * base + id + 1
        return (h * base + (ids.to(torch.int64) + 1) % mod) % mod
    for start in range(0, ids.shape[1], _HASH_CHUNK):
        chunk = ids[:, start : start + _HASH_CHUNK].to(torch.int64)
        T = chunk.shape[1]
        # powers[j] = base^j mod p, j < T, by doubling: log2(T) vectorised steps instead of T Python steps
        powers = torch.ones(1, 2, dtype=torch.int64, device=ids.device)
        while powers.shape[0] < T:
            n = powers.shape[0]
            step = torch.tensor([pow(b, n, p) for b, p in zip(_HASH_BASES, _HASH_MODULI)], device=ids.device)
            powers = torch.cat((powers, powers * step % mod))
        powers = powers[:T].flip(0)  # [T, 2]: base^(T-1-i)
        terms = ((chunk + 1) % mod[:, None, None]).permute(1, 2, 0) * powers % mod  # [B, T, 2]
        shift = torch.tensor([pow(b, T, p) for b, p in zip(_HASH_BASES, _HASH_MODULI)], device=ids.device)
        h = (h * shift % mod + terms.sum(1) % mod) % mod
    return h


class TokenFingerprint:
    """The fingerprint of the token ids a cache consumed: `value` [B, 2] int64 (None: no tokens yet), `known`
    (False once a forward came with inputs_embeds or a crop went past what was recorded: nothing to compare with),
    and while past recording is on, `records` (before [B, 2], ids [B, T]) per forward, what crop() rolls back."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.value, self.known, self.records = None, True, []

    def forget(self) -> None:
        """The tokens are no longer known (inputs_embeds, or ids that are not [B, T] integers)."""
        self.value, self.known, self.records = None, False, []

    def extend(self, ids: torch.Tensor, record: bool) -> None:
        """Add a forward's ids [B, T]; with `record`, keep what crop() needs to take them back."""
        if not self.known:
            return
        before = self.value
        if before is None:
            before = torch.zeros(ids.shape[0], 2, dtype=torch.int64, device=ids.device)
        self.value = extend_fingerprint(before, ids)
        if record:
            self.records.append((before, ids.detach().clone()))

    def differing_rows(self, ids: torch.Tensor) -> list[int]:
        """Rows of ids [B, L] that are not the tokens consumed ([] when they are, or when unknown)."""
        if not self.known or self.value is None:
            return []
        got = extend_fingerprint(torch.zeros(ids.shape[0], 2, dtype=torch.int64), ids)
        return (got.to(self.value.device) != self.value).any(-1).nonzero().flatten().tolist()

    def crop(self, n: int, remaining: int) -> None:
        """Take back the last -n tokens (n <= 0), `remaining` tokens being left; unknown when not recorded."""
        records, self.records = self.records, []
        if remaining == 0:
            self.value, self.known = None, True
            return
        if not n or not self.known:
            return
        if -n > sum(ids.shape[1] for _, ids in records):  # not recorded: the remaining tokens' hash is unknown
            self.value, self.known = None, False
            return
        while n:
            before, ids = records.pop()
            T = ids.shape[1]
            if -n >= T:
                self.value, n = before, n + T
            else:
                self.value, n = extend_fingerprint(before, ids[:, : T + n]), 0

    def map_rows(self, fn) -> None:
        """Apply a batch reordering / selection `fn` to every row-indexed tensor."""
        if self.value is not None:
            self.value = fn(self.value)
        self.records = [(fn(before), fn(ids)) for before, ids in self.records]

    def nbytes(self) -> int:
        return 0 if self.value is None else self.value.numel() * 8


__all__ = ["TokenFingerprint", "extend_fingerprint"]
