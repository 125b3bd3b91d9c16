"""Training tooling (not carried by checkpoints: the modeling code never imports it).

    data.py   packed-document batches, the packed loss, validation, the byte-level BPE builder
    loop.py   the training loop of examples/train.py and examples/distill.py (`fit`, `add_arguments`)
"""
