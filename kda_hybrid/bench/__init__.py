"""Benchmark tooling (not carried by checkpoints: the modeling code never imports it).

    report.py   the command line, environment record and output every script in benchmarks/ shares
    native.py   transformers' native Kimi Linear with our weights on CPU (`block_fla`, `native_twin`)
    shapes.py   the 6.5M shape and its same-size Llama twin (docs/architecture.md §7)
"""
