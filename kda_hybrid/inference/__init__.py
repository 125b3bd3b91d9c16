"""Inference helpers beside `generate` (not carried by checkpoints: the modeling code never imports them).

    long_context.py   `prefill`: a prompt of any length through the cache a chunk at a time
"""
