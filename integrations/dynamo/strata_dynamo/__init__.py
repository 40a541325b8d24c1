"""strata as an NVIDIA Dynamo worker.

`python -m strata_dynamo` starts (or attaches to) a `strata serve`, registers it with
Dynamo's discovery as a token-in/token-out worker with strata's KV block size, forwards
token requests and cancellations to strata's `/v1/completions`, streams the generated
token ids back, and relays strata's KV-cache events (vLLM's ZMQ format) to Dynamo's KV
router. See docs/distributed.md.
"""
