"""Prefix caching of decoder prompts: the chained block hash and the index both twins' managers keep.

Many rows share the start of their decoder prompt (task and language tokens, a
biasing prompt, the previous segment's text). A row that ``retire``s publishes
its full self pages under a chained hash, and a later row's ``admit_prompt``
binds the longest published prefix of its prompt instead of recomputing it::

    prompt tokens  | t0 .. t3 | t4 .. t7 | t8 .. t10 |        (page = 4)
    block hash     h0 = H(ROOT, t0..t3)  h1 = H(h0, t4..t7)   (the partial last page is never hashed)
    cached         at most the full blocks strictly before the last token: 8 of 11 here

A hit is accepted only if the pool still names that block by the same hash
(``BlockPool.key_of``: a reclaimed parked block forgets its key) and the token
ids of the whole prefix up to that block are equal, so a hash collision can
never alias two prompts. Host bookkeeping only: no device work happens here.

Scope. The chain starts from ``scope`` (default 0). Prompt K/V are a function of
the token ids only in the first decoder layer: in an attention decoder with
cross-attention in every layer (U2/WeNet, Whisper), the K/V of later layers
depend on the encoder output too. Such a decoder may share a prompt's pages
only among rows that attend to the same encoder output (the beams or the n-best
hypotheses of one utterance): pass that utterance's id as ``scope``. Rows of
different scopes never share.
"""

from __future__ import annotations

ROOT = 0  # the parent hash of a prompt's first block


def block_hash(parent: int, tokens: tuple) -> int:
    """The chained hash of one full block: its token ids and its parent block's hash."""
    return hash((parent, tokens))


def check_tokens(tokens, op: str) -> tuple:
    """Token ids as a tuple of ints (``ValueError`` naming ``op`` for anything else, bools included)."""
    ids = tuple(tokens.tolist() if hasattr(tokens, "tolist") else tokens)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"{op}: token ids must be ints, got {t!r}")
    return ids


class PrefixIndex:
    """Chained block hash -> (block id, (scope, the prompt's tokens up to that block's end))."""

    hash_block = staticmethod(block_hash)  # tests swap it for a colliding one

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._entries: dict[int, tuple[int, tuple]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget every published prefix."""
        self._entries.clear()

    def _chain(self, tokens: tuple, blocks: int, scope=0):
        page = self.page_size
        parent = ROOT if scope == 0 else self.hash_block(ROOT, ("scope", scope))
        for i in range(blocks):
            parent = self.hash_block(parent, tokens[i * page : (i + 1) * page])
            yield i, parent

    def lookup(self, pool, tokens: tuple, scope=0) -> list[int]:
        """The blocks of the longest cached prefix of ``tokens``: whole blocks, strictly fewer tokens
        than the prompt (its last token is always computed, it gives the first step's logits)."""
        hits = []
        for i, h in self._chain(tokens, max(len(tokens) - 1, 0) // self.page_size, scope):
            entry = self._entries.get(h)
            end = (i + 1) * self.page_size
            if entry is None or pool.key_of(entry[0]) != h or entry[1] != (scope, tokens[:end]):
                break
            hits.append(entry[0])
        return hits

    def publish(self, pool, tokens: tuple, blocks, scope=0) -> tuple[list[int], list[int]]:
        """Which of a row's full ``blocks`` (holding ``tokens``) to publish, and their keys: those whose
        prefix is not cached yet (a prefix already cached keeps its block). Records them."""
        ids, keys = [], []
        for i, h in self._chain(tokens, len(tokens) // self.page_size, scope):
            entry = self._entries.get(h)
            if entry is not None and pool.key_of(entry[0]) == h:
                continue
            end = (i + 1) * self.page_size
            self._entries[h] = (int(blocks[i]), (scope, tokens[:end]))
            ids.append(int(blocks[i]))
            keys.append(h)
        return ids, keys

    def adopt(self, pool, block: int, tokens: tuple, scope=0):
        """Record ``block`` as the published block of ``tokens`` (a whole-page prefix, a session's page
        loaded again) unless the pool already names another block by that prefix; returns the key for
        ``pool.publish``, or None when the prefix is cached already (``block`` then stays private)."""
        chain = list(self._chain(tuple(tokens), len(tokens) // self.page_size, scope))
        h = chain[-1][1] if chain else None
        entry = self._entries.get(h)
        if h is None or (entry is not None and pool.key_of(entry[0]) == h):
            return None
        self._entries[h] = (int(block), (scope, tuple(tokens)))
        return h

    def pinned(self, pool) -> list[int]:
        """Published blocks the pool still names (held or parked); entries whose block the pool has
        reclaimed are dropped here, so the index does not outgrow the pool."""
        self._entries = {h: e for h, e in self._entries.items() if pool.key_of(e[0]) == h}
        return [b for b, _ in self._entries.values()]
