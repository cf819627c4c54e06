"""Benchmarks: ``python -m sparsetp.bench attention|tp [--flags]``.

Each command lives in its own module (:mod:`sparsetp.bench.attention`, :mod:`sparsetp.bench.tp`)
with a ``main(argv)`` entry point and importable functions; :mod:`sparsetp.bench.common` holds
what they share (output flags, versions, JSON, progress, timing). Frameworks are imported lazily,
so importing this package costs nothing.
"""
