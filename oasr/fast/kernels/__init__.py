"""The CUDA kernels of ``oasr/kernels_cu/`` and the two ways to run them.

    registry.py    every kernel: family (source file), parameters, instantiations
    nvrtc.py       NVRTC compile (cached cubins + ptxas report), load, launch on torch's current stream
    emulation.py   g++ build against oasr/kernels_cu/emu/simt_emu.h, ctypes launch on CPU tensors
    ops.py         launchers: PagedKVCache calls -> grids and arguments, for either executor
                   (attention: v1 or v2, and the split count)
    testing.py     random scenarios (shuffled tables, NaN-poisoned pools) shared by the tests
    sass.py        SASS reading: disassembly, each kernel's main loop and instruction mix
    perf_model.py  the paper model of the attention kernels' speed on an H200, and its calibration
    sass_report.py ``python -m oasr kernels --sass``: both over the registry, and the tables

Callers normally go through ``oasr.fast.paged_ops``, which picks the executor
(see ``oasr.fast.backend``).
"""
