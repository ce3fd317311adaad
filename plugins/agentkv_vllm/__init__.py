"""agentkv's vLLM plugin: the only package of agentkv that imports vllm.

Modules:
  plugin        ``vllm.general_plugins`` entry point: registers AgentKVConnector (idempotent)
  connector     AgentKVConnector(KVConnectorBase_V1): dispatches to the scheduler or worker side
  scheduler_side  thin adapter from vLLM's scheduler hooks to agentkv.manager.TrajectoryManager
  control_ops   the control thread's ops (pause, resume, end, get, status, metrics, tick)
  engine_config what the scheduler side derives from vLLM's config and the connector settings
  worker_side   executes store/load jobs between vLLM's KV cache and the tier store
  layerwise_loads  the worker's layer-by-layer loads (a copier thread racing the forward pass)
  block_copy    the one layout-specific piece: torch byte views of whole engine blocks
  device_copy   layer-by-layer copies into the KV cache with per-layer completion (CUDA events)
  params        the request contract (``kv_transfer_params.agentkv``), validated with pydantic
  settings      ``kv_connector_extra_config``, validated with pydantic
  control       the local ZMQ channel between the HTTP routes and the scheduler-side connector
  routes        ``vllm.endpoint_plugins`` entry point: /agentkv/v1/... routes
"""
