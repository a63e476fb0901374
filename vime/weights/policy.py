"""When a weight synchronisation flushes the engines' KV cache (``--flush-cache-interval``)."""


def flush_for_sync(sync_number: int, interval: int) -> bool:
    """``sync_number`` counts synchronisations of this process from 1; the first always flushes.

    1: every sync flushes. <= 0: only the first. N > 1: the first, then every N-th
    (N = 2 keeps KV at version 2, flushes at 3, keeps at 4, ...).
    """
    if sync_number < 1:
        raise ValueError("sync_number counts from 1")
    if sync_number == 1 or interval == 1:
        return True
    if interval <= 0:
        return False
    return (sync_number - 1) % interval == 0
