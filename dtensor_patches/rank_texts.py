"""Every rank's short text (a reproducer's or a replay's finding), exchanged without NumPy."""

from __future__ import annotations

__all__ = ["gather_texts"]


def gather_texts(text: str | None) -> list[str | None]:
    """Each rank's ``text`` (``None`` for "nothing wrong"), in rank order (collective over the
    default process group).

    Sent as UTF-8 bytes in uint8 tensors rather than with ``all_gather_object``, which needs
    NumPy on some releases (2.10: ``RuntimeError: Numpy is not available``); torch does not
    depend on NumPy, and neither do the tripwires.
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    # b"" is "nothing"; a text is b"!" + its bytes, so an empty text still counts.
    payload = b"" if text is None else b"!" + text.encode("utf-8")
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(max(longest, 1), dtype=torch.uint8)
    buf[: len(payload)] = torch.tensor(list(payload), dtype=torch.uint8)
    bufs = [torch.zeros_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf)
    everyone: list[str | None] = []
    for s, b in zip(sizes, bufs, strict=True):
        raw = bytes(b[: int(s.item())].tolist())
        everyone.append(None if not raw else raw[1:].decode("utf-8", errors="replace"))
    return everyone
