"""The fast twin's decoder K/V cache: ``DecoderKVCacheManager`` and ``DenseDecoderKV``.

Fast twin of ``oasr.reference.decoder_cache`` (one module there; here a package
because the fast manager's numpy bookkeeping, its dispatch by size and its
host step handle would not fit one file):

    manager.py     ``DecoderKVCacheManager``: its contract, its state, block ownership,
                   the device mirror, the counts; built from the parts below
    admission.py   admit, finish, restore (rows coming and going)
    views.py       the paged views of both regions, the dense gathers
    writes.py      fill_cross, prefill, extend, rewind, trim
    steps.py       one decode step: prepare, open_step (``HostStep``), commit, append
    prefix.py      prefix caching: admit_prompt, retire, evict, abandon, reset
    beams.py       select: keep, drop, fork onto shared pages
    sizes.py       the dispatch by size (a beam's element-wise paths)
    dense.py       ``DenseDecoderKV``: dense per-group storage with the fast quantization rule
"""

from oasr.fast.decoder_cache.dense import DenseDecoderKV
from oasr.fast.decoder_cache.manager import DecoderKVCacheManager

__all__ = ["DecoderKVCacheManager", "DenseDecoderKV"]
