"""``python -m oasr formats``: the K/V page formats, their bytes, and what serves them on this machine.

Prints, for the model dtype ``--dtype`` and each head_dim of ``--head-dims``: every format of
``oasr.kv_formats`` with its bytes per (frame, KV head) vector and its ratio to the model dtype;
then the gate's matrix for ``--device``: which backends of the fast twin serve each format at each
head_dim (the reference twin serves every format whose rule cuts the head_dim), and what ``"auto"``
picks. ``--check FORMAT`` runs the whole gate on one configuration (``--head-dim``, ``--block-size``,
``--backend``) and exits 2 with the refusal on one stderr line when the format is refused there,
0 when it is served. ``--json PATH`` also writes the tables.
"""

from __future__ import annotations

import json
import sys

from oasr.commands import CommandParser, check_device, check_output_path

_DTYPES = ("float32", "float16", "bfloat16")


def _parser() -> CommandParser:
    p = CommandParser(prog="python -m oasr formats", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="float16", choices=_DTYPES, help="the model dtype")
    p.add_argument("--head-dims", default="64,80,128", help="comma-separated head dims for the tables")
    p.add_argument("--check", metavar="FORMAT", default=None, help="gate one configuration (exit 2 if refused)")
    p.add_argument("--head-dim", type=int, default=64, help="--check: head_dim")
    p.add_argument("--block-size", type=int, default=16, help="--check: block_size_frames")
    p.add_argument("--backend", default=None, choices=("torch", "emulated", "cuda"),
                   help="--check: the fast twin's backend (default: what a call would use)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the tables as JSON (default: not written)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m oasr formats`` with ``argv`` (the process's arguments by default); returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    check_device(parser, args.device)
    try:
        head_dims = [int(x) for x in args.head_dims.split(",")]
    except ValueError:
        parser.error(f"--head-dims must be comma-separated ints, got {args.head_dims!r}")
    if any(d <= 0 for d in head_dims) or args.head_dim <= 0 or args.block_size <= 0:
        parser.error("--head-dims, --head-dim and --block-size must be positive")
    if args.json:
        check_output_path(parser, args.json, "--json")

    import torch

    from oasr.cache.config import CacheConfig
    from oasr.fast.kv_formats import check_format_supported, supported_matrix
    from oasr.kv_formats import FORMATS, auto_format

    dtype = getattr(torch, args.dtype)
    if args.check is not None:
        try:
            config = CacheConfig(head_dim=args.head_dim, block_size_frames=args.block_size, chunk_size=args.block_size,
                                 device=args.device, dtype=dtype, kv_cache_dtype=args.check)
            check_format_supported(config.kv_cache_dtype, config.head_dim, config.device, dtype=dtype,
                                   backend=args.backend)
        except (ValueError, KeyError) as exc:
            print(f"{parser.prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
            return 2
        print(f"{args.check}: served (head_dim={args.head_dim}, block_size={args.block_size}, {args.dtype}, "
              f"{args.device}, backend {args.backend or 'default'}) -> kv_cache_dtype={config.kv_cache_dtype!r}")
        return 0

    bytes_rows = {name: {d: f.bytes_per_vector(d, dtype) for d in head_dims
                         if d % max(f.group, f.values_per_byte, 1) == 0} for name, f in FORMATS.items()}
    print(f"bytes per (frame, KV head) vector, model dtype {args.dtype} (ratio: the model dtype's / the format's)")
    print(f"  {'format':12s}" + "".join(f"{'D=' + str(d):>16s}" for d in head_dims) + "  rule")
    for name, f in FORMATS.items():
        cells = []
        for d in head_dims:
            b = bytes_rows[name].get(d)
            cells.append(f"{'-':>16s}" if b is None else f"{b:>8d} ({bytes_rows['model'][d] / b:4.2f}x)")
        print(f"  {name:12s}" + "".join(cells) + f"  {f.summary}")

    matrix = supported_matrix(head_dims, args.device, dtype)
    backends = sorted({b for (_, _, b) in matrix})
    print(f"\nfast twin on {args.device} ({', '.join(backends)}): ok, or why not (the reference serves every "
          "format whose rule cuts head_dim)")
    for name in FORMATS:
        row = []
        for d in head_dims:
            cell = "/".join("ok" if matrix[(name, d, b)] is None else "-" for b in backends)
            row.append(f"{cell:>16s}")
        print(f"  {name:12s}" + "".join(row))
    reasons = sorted({r for r in matrix.values() if r})
    for r in reasons:
        print(f"    - {r}")
    autos = {d: auto_format(args.device, d, dtype) for d in head_dims}
    print("\nauto picks: " + ", ".join(f"D={d}: {p}" for d, p in autos.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"dtype": args.dtype, "device": args.device, "bytes_per_vector": bytes_rows,
                       "served": {f"{n}/{d}/{b}": r is None for (n, d, b), r in matrix.items()},
                       "auto": autos}, fh, indent=1)
    return 0
