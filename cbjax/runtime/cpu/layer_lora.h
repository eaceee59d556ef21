// The layer kernel with each row's LoRA adapter (lora.h), its pool's arrays as buffers.
#pragma once

#include "layer.h"
#include "lora.h"

namespace {

// `DecoderLayerAt` with each row's LoRA adapter (lora.h): its slot [M], the pool's scales [slots]
// and each module's stacked A [layers, slots, rank, in] and B [layers, slots, out, rank] (a module
// the pool does not hold: bit clear in `modules`, its buffers one element), read at `layer`.
ffi::Error DecoderLayerAtLora(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U32> addresses, ffi::Buffer<ffi::F32> cos,
                              ffi::Buffer<ffi::F32> sin, ffi::AnyBuffer cache_k, ffi::AnyBuffer cache_v,
                              ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> positions,
                              ffi::Buffer<ffi::S32> valid, ffi::ResultBuffer<ffi::F32> x_out,
                              ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out, float eps,
                              float scale, int64_t num_heads, int64_t num_kv_heads, int64_t window,
                              int64_t page_size, int64_t head_stride, int64_t page_stride, int64_t num_pages,
                              int64_t layer, int64_t intermediate, int64_t head_dim, ffi::Buffer<ffi::S32> slots,
                              ffi::Buffer<ffi::F32> lora_scale, ffi::Buffer<ffi::F32> qa, ffi::Buffer<ffi::F32> qb,
                              ffi::Buffer<ffi::F32> ka, ffi::Buffer<ffi::F32> kb, ffi::Buffer<ffi::F32> va,
                              ffi::Buffer<ffi::F32> vb, ffi::Buffer<ffi::F32> oa, ffi::Buffer<ffi::F32> ob,
                              ffi::Buffer<ffi::F32> ga, ffi::Buffer<ffi::F32> gb, ffi::Buffer<ffi::F32> ua,
                              ffi::Buffer<ffi::F32> ub, ffi::Buffer<ffi::F32> da, ffi::Buffer<ffi::F32> db,
                              int64_t rank, int64_t modules) {
  const int64_t M = x.dimensions().front(), S = static_cast<int64_t>(lora_scale.element_count());
  if (static_cast<int64_t>(slots.element_count()) != M || rank < 1 || rank > kMaxLoraRank) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_decoder_layer_at_lora: bad adapter slots or rank");
  }
  LayerLora lora{slots.typed_data(), valid.typed_data(), lora_scale.typed_data(), rank};
  const ffi::Buffer<ffi::F32>* pools[7][2] = {{&qa, &qb}, {&ka, &kb}, {&va, &vb}, {&oa, &ob},
                                              {&ga, &gb}, {&ua, &ub}, {&da, &db}};
  LoraModule* targets[7] = {&lora.q, &lora.k, &lora.v, &lora.o, &lora.gate, &lora.up, &lora.down};
  for (int m = 0; m < 7; ++m) {
    if (!(modules >> m & 1)) continue;
    const auto ad = pools[m][0]->dimensions(), bd = pools[m][1]->dimensions();  // [L, S, r, in], [L, S, out, r]
    if (ad.size() != 4 || bd.size() != 4 || ad[1] != S || bd[1] != S || ad[2] != rank || bd[3] != rank ||
        layer < 0 || layer >= ad[0] || bd[0] != ad[0]) {
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_decoder_layer_at_lora: bad adapter pool");
    }
    *targets[m] = {pools[m][0]->typed_data() + layer * S * rank * ad[3],
                   pools[m][1]->typed_data() + layer * S * bd[2] * rank, ad[3], bd[2]};
  }
  return decoder_layer_at(x, addresses, cos, sin, cache_k, cache_v, tables, positions, valid, x_out, k_out, v_out,
                          eps, scale, num_heads, num_kv_heads, window, page_size, head_stride, page_stride, num_pages,
                          layer, intermediate, head_dim, &lora);
}

}  // namespace
