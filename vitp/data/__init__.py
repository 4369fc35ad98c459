"""Data: sources, the synthetic fractal corpus, decode/validate/quarantine, Parquet shards, ingest.

Import submodules directly (`from vitp.data.ingest import build_train_dataset`); this
package imports nothing heavy so `vitp config` stays instant. Must not import model/train.
"""
