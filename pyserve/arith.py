"""Integer arithmetic every layer needs (blocks for tokens, shards of a vocabulary)."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many b-sized pieces hold a."""
    return -(-a // b)
