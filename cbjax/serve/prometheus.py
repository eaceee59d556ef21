"""`/metrics` in Prometheus text, under vLLM's metric names so existing dashboards and
benchmark scrapers read it unchanged. One registry per server (tests run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cbjax import Load, RequestOutput

# vLLM's buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # no `_created` series (vLLM's /metrics has none either)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests holding a slot (prefilling or decoding).")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting for a slot.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "Fraction of the KV cache in use (slots, or pages for the paged cache), 0 to 1.")
        self.preemptions = gauge("vllm:num_preemptions", "Preemptions since the server started.")
        self.prefix_queries = gauge("cbjax:prefix_cache_queries", "Full prompt pages looked up in the prefix cache.")
        self.prefix_hits = Gauge("cbjax:prefix_cache_hits", "Full prompt pages found cached, by tier (device pages, "
                                 "or host memory and loaded back).", labels + ["tier"], registry=r)
        self.swaps = gauge("cbjax:kv_swaps_out", "Preemptions whose KV was swapped to host memory.")
        self.swap_fallbacks = gauge("cbjax:kv_swap_fallbacks", "Swap preemptions recomputed: host memory was full.")
        self.host_kv_usage = gauge("cbjax:host_kv_cache_usage_perc", "Fraction of the KV host tier in use, 0 to 1.")
        self.spec_drafts = gauge("vllm:spec_decode_num_drafts", "Speculative decoding: rows verified (proposals).")
        self.spec_draft_tokens = gauge("vllm:spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed.")
        self.spec_accepted = gauge("vllm:spec_decode_num_accepted_tokens", "Speculative decoding: tokens accepted.")
        self.spec_rate = gauge("cbjax:spec_decode_acceptance_rate", "Accepted / proposed tokens, 0 to 1.")
        self.spec_length = gauge("cbjax:spec_decode_mean_accepted_length",
                                 "Tokens a verified row makes, on average: 1 + accepted / rows.")
        self.expert_tokens = Gauge("cbjax:moe_expert_tokens", "Mixture of experts: tokens each MoE layer sent to "
                                   "each expert since the server started.", labels + ["layer", "expert"], registry=r)
        self.expert_imbalance = gauge("cbjax:moe_expert_imbalance", "Mixture of experts: the busiest expert's tokens "
                                      "over the mean expert's, averaged over the MoE layers (1: balanced).")
        self.lora_loads = gauge("cbjax:lora_loads", "LoRA adapters written into a device slot since the start.")
        self.lora_hits = gauge("cbjax:lora_hits", "Requests placed whose LoRA adapter was on the device already.")
        self.lora_waits = gauge("cbjax:lora_waits", "Requests that waited for their LoRA adapter's device slot.")
        self.lora_wait = gauge("cbjax:lora_wait_seconds", "Those requests' time from arrival to placement, summed.")
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of the requests started.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels,
                                         registry=r).labels(model_name)
        self.success = Counter("vllm:request_success", "Requests finished, by finish reason.",
                               labels + ["finished_reason"], registry=r)
        self.model_name = model_name
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Per request: (finish - first token) / (tokens - 1).", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Arrival to the first prefill chunk.",
                               E2E_BUCKETS)

    def observe(self, output: RequestOutput) -> None:
        """Called on the engine thread for every output the loop delivers."""
        m = output.metrics
        if output.new_token_ids:
            self.generation_tokens.inc(len(output.new_token_ids))
            if len(output.new_token_ids) == len(output.token_ids):  # its first tokens
                self.prompt_tokens.inc(len(output.prompt_token_ids))
        if not output.finished or m is None:
            return
        if m.finish_time is not None:
            self.e2e.observe(m.finish_time - m.arrival_time)
        if m.scheduled_time is not None:
            self.queue.observe(m.scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        times = m.token_times
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))

    def finished(self, reason: str, count: int = 1) -> None:
        """A choice ended, with the reason its client sees (a stop string is "stop" even when
        the engine reached max_tokens in the same round; a client gone away is "abort")."""
        if count:
            self.success.labels(self.model_name, reason).inc(count)

    def set_load(self, load: Load) -> None:
        self.running.set(load.running)
        self.waiting.set(load.waiting)
        self.kv_usage.set(load.kv_cache_usage)
        self.preemptions.set(load.num_preemptions)
        self.prefix_queries.set(load.prefix_queries)
        self.prefix_hits.labels(self.model_name, "device").set(load.prefix_hits)
        self.prefix_hits.labels(self.model_name, "host").set(load.prefix_host_hits)
        self.swaps.set(load.swaps_out)
        self.swap_fallbacks.set(load.swap_fallbacks)
        self.host_kv_usage.set(load.host_kv_cache_usage)
        self.lora_loads.set(load.lora_loads)
        self.lora_hits.set(load.lora_hits)
        self.lora_waits.set(load.lora_waits)
        self.lora_wait.set(load.lora_wait_s)
        self.spec_drafts.set(load.spec_drafts)
        self.spec_draft_tokens.set(load.spec_draft_tokens)
        self.spec_accepted.set(load.spec_accepted_tokens)
        self.spec_rate.set(load.spec_accepted_tokens / load.spec_draft_tokens if load.spec_draft_tokens else 0.0)
        self.spec_length.set(1 + load.spec_accepted_tokens / load.spec_drafts if load.spec_drafts else 0.0)
        if load.expert_tokens is not None:
            for layer, row in enumerate(load.expert_tokens):
                for expert, count in enumerate(row):
                    self.expert_tokens.labels(self.model_name, str(layer), str(expert)).set(int(count))
            self.expert_imbalance.set(load.expert_imbalance)

    def render(self, load: Load) -> bytes:
        self.set_load(load)
        return generate_latest(self.registry)
