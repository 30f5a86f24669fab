"""The retrieval side: embed the KB into shards, index them (ScaNN or exact), evaluate with the KILT
metrics, mine hard negatives and serve search over HTTP. Submodules import lazily (ScaNN and the
model stack are heavy), so import what you need: `from t5_retrieval.retrieval import metrics`."""
