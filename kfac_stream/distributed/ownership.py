"""Which rank owns which factor: a pure, deterministic, printable assignment.

Greedy LPT (longest processing time first) on stored bytes: factors sorted by bytes (ties by
key), each given to the rank with the fewest bytes so far (ties by lowest rank). The result is
within one largest factor of the mean load. The eigendecomposition cost (``d³``) per rank is
reported beside it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ownership:
    """``owner[key] -> rank`` plus per-rank loads, with a readable ``__str__``."""

    owner: dict[str, int]
    bytes_per_rank: tuple[int, ...]
    eigh_flops_per_rank: tuple[float, ...]

    def owned_by(self, rank: int) -> list[str]:
        """Keys owned by ``rank``, in assignment order."""
        return [k for k, r in self.owner.items() if r == rank]

    def __str__(self) -> str:
        lines = ["rank  factors      bytes   eigh flops"]
        for r, (b, f) in enumerate(zip(self.bytes_per_rank, self.eigh_flops_per_rank)):
            lines.append(f"{r:4d}  {len(self.owned_by(r)):7d}  {b:9d}   {f:10.3g}")
        return "\n".join(lines)


def assign_owners(dims: dict[str, tuple[int, bool]], world_size: int,
                  bytes_per_entry: int) -> Ownership:
    """Assign every factor to one rank.

    Args:
        dims: ``{key: (side d, diagonal)}``; a dense factor stores ``d²`` entries, a diagonal
            one ``d``.
        world_size: Number of ranks (≥ 1).
        bytes_per_entry: Storage bytes per entry (2 for float16).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be ≥ 1")

    def cost(key: str) -> int:
        d, diag = dims[key]
        return (d if diag else d * d) * bytes_per_entry

    loads = [0] * world_size
    flops = [0.0] * world_size
    owner: dict[str, int] = {}
    for key in sorted(dims, key=lambda k: (-cost(k), k)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owner[key] = rank
        loads[rank] += cost(key)
        d, diag = dims[key]
        flops[rank] += 0.0 if diag else float(d) ** 3
    ordered = {k: owner[k] for k in dims}
    return Ownership(ordered, tuple(loads), tuple(flops))
