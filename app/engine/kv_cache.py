"""The KV cache manager: a pool of fixed-size blocks, handed to requests as they grow.

Prefix caching: a full block is named by a hash chained over every token up to its end (and the
model's identity), so two requests with the same prefix find the same blocks. Blocks are shared by
reference count and stay cached after release until their memory is needed, least recently used
first. Callers get block ids and counts back, never the pool's own structures.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from app.engine.request import Request


@dataclass(frozen=True)
class KVCacheConfig:
    """One rank's KV cache: what the model runner allocates and the manager hands out, in one place."""

    num_blocks: int
    block_size: int  # tokens per block
    dtype: str | None = None  # "float32", "bfloat16" or "float16"; None: the model's dtype
    prefix_caching: bool = True


@dataclass(frozen=True)
class PrefixHit:
    block_ids: tuple[int, ...]  # cached blocks holding the request's first tokens
    num_tokens: int  # tokens they cover


class BlockPool:
    """Blocks, their reference counts, and the cached-but-free ones in least-recently-used order."""

    def __init__(self, num_blocks: int):
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU first
        self.by_hash: dict[bytes, int] = {}

    def num_free(self) -> int:
        return len(self.free)

    def take(self, count: int) -> list[int]:
        """`count` unused blocks, evicting the least recently used cached ones."""
        blocks = []
        for _ in range(count):
            block, _ = self.free.popitem(last=False)
            self.forget(block)
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference each; blocks reaching zero become free (most recently used last)."""
        for block in blocks:
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None

    def lookup(self, block_hash: bytes) -> int | None:
        return self.by_hash.get(block_hash)

    def remember(self, block: int, block_hash: bytes) -> None:
        if self.block_hash[block] is None and block_hash not in self.by_hash:
            self.block_hash[block] = block_hash
            self.by_hash[block_hash] = block

    def forget(self, block: int) -> None:
        """No later lookup finds this block (it stays in use where it is)."""
        old = self.block_hash[block]
        if old is not None:
            del self.by_hash[old]
            self.block_hash[block] = None


class KVCacheManager:
    def __init__(self, cfg: KVCacheConfig, model_id: str = ""):
        self.block_size, self.prefix_caching, self.num_blocks = cfg.block_size, cfg.prefix_caching, cfg.num_blocks
        self.pool = BlockPool(cfg.num_blocks)
        self._blocks: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # the chain of each request's full blocks so far
        self._root = hashlib.blake2b(model_id.encode(), digest_size=16).digest()
        self.hits = self.queries = 0  # prefix-cache tokens found / looked up

    # --- queries ---

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._blocks.get(request_id, ()))

    def num_free_blocks(self) -> int:
        return self.pool.num_free()

    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free() / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache ---

    def find_prefix(self, request: Request) -> PrefixHit:
        """The longest run of cached blocks at the start of the request's tokens.

        At least the last token is always left to compute, since its logits are needed.
        """
        if not self.prefix_caching:
            return PrefixHit((), 0)
        tokens = request.token_ids()
        usable = (len(tokens) - 1) // self.block_size
        blocks, parent = [], self._root
        for index in range(usable):
            parent = self._hash(parent, tokens[index * self.block_size:(index + 1) * self.block_size])
            block = self.pool.lookup(parent)
            if block is None:
                break
            blocks.append(block)
        return PrefixHit(tuple(blocks), len(blocks) * self.block_size)

    def count_prefix(self, request: Request, hit: PrefixHit) -> None:
        """Record one admitted request's lookup (retries of a request still waiting do not count)."""
        if self.prefix_caching:
            self.queries += request.num_tokens
            self.hits += hit.num_tokens

    def _hash(self, parent: bytes, tokens: Sequence[int]) -> bytes:
        data = parent + b"".join(t.to_bytes(4, "little", signed=True) for t in tokens)
        return hashlib.blake2b(data, digest_size=16).digest()

    # --- allocation ---

    def can_allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        return self._new_blocks_needed(request, num_new_tokens, hit) <= self.pool.num_free() - self._hit_free(hit)

    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after its prefix hit, if any)."""
        if not self.can_allocate(request, num_new_tokens, hit):
            return False
        blocks = self._blocks.setdefault(request.request_id, [])
        if hit is not None and hit.block_ids and not blocks:
            self.pool.share(hit.block_ids)
            blocks.extend(hit.block_ids)
        blocks.extend(self.pool.take(self._new_blocks_needed(request, num_new_tokens, hit)))
        return True

    def tokens_free(self, request: Request) -> int:
        """Tokens past the request's computed ones that the blocks it holds and the free ones could take."""
        held = len(self._blocks.get(request.request_id, ()))
        return (held + self.pool.num_free()) * self.block_size - request.num_computed_tokens

    def trim(self, request: Request) -> None:
        """Give back the blocks past what the request's tokens need (those its rejected drafts took); never named."""
        blocks = self._blocks.get(request.request_id)
        keep = self.blocks_needed(request.num_tokens)
        if blocks is not None and len(blocks) > keep:
            self.pool.release(list(reversed(blocks[keep:])))
            del blocks[keep:]

    def _new_blocks_needed(self, request: Request, num_new_tokens: int, hit: PrefixHit | None) -> int:
        held = len(self._blocks.get(request.request_id, ())) or (len(hit.block_ids) if hit else 0)
        computed = max(request.num_computed_tokens, hit.num_tokens if hit else 0)
        return max(self.blocks_needed(computed + num_new_tokens) - held, 0)

    def _hit_free(self, hit: PrefixHit | None) -> int:
        """Hit blocks that sit in the free list: sharing them takes them out of it."""
        if hit is None:
            return 0
        return sum(1 for block in hit.block_ids if self.pool.ref_count[block] == 0)

    def cache_full_blocks(self, request: Request) -> None:
        """Name the request's newly filled blocks so later requests can find them."""
        if not self.prefix_caching:
            return
        blocks, chain = self._blocks.get(request.request_id, []), self._hashes.setdefault(request.request_id, [])
        full = min(request.num_computed_tokens // self.block_size, len(blocks))
        if len(chain) >= full:
            return
        tokens = request.token_ids(0, full * self.block_size)
        for index in range(len(chain), full):
            parent = chain[-1] if chain else self._root
            chain.append(self._hash(parent, tokens[index * self.block_size:(index + 1) * self.block_size]))
            self.pool.remember(blocks[index], chain[-1])

    def forget(self, request: Request) -> None:
        """No later request finds any of this request's blocks (what they hold is not to be trusted)."""
        for block in self._blocks.get(request.request_id, ()):
            self.pool.forget(block)

    def free(self, request: Request) -> None:
        """Return the request's blocks, its last blocks first so that its prefix stays cached longest."""
        self.pool.release(list(reversed(self._blocks.pop(request.request_id, []))))
        self._hashes.pop(request.request_id, None)
