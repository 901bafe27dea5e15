"""`kfac_stream.distributed.ownership`: factors assigned to ranks balanced by bytes and
deterministically."""

from kfac_stream.distributed.ownership import assign_owners


def test_assign_owners_balances_bytes_and_is_deterministic():
    dims = {f"l{i}.{f}": (d, False) for i, d in enumerate([768, 256, 1024, 256, 64])
            for f in "AG"}
    own = assign_owners(dims, 3, 2)
    assert own == assign_owners(dims, 3, 2)
    total = sum(own.bytes_per_rank)
    largest = max(d * d * 2 for d, _ in dims.values())
    assert all(abs(b - total / 3) <= largest for b in own.bytes_per_rank)
    assert set(own.owner) == set(dims)
    assert "rank" in str(own)
    single = assign_owners(dims, 1, 2)
    assert set(single.owner.values()) == {0}
