"""What the experiment scripts share: flags and workloads (`common`), the GPU bench's sections
(`device_*`), the transformers peers (`hf_peers`), published GPU measurements (`published_validation`)."""
