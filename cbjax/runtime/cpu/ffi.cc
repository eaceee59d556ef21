// CPU kernels of cbjax's decode steps, as XLA FFI custom calls (cbjax/runtime/cpu/kernels.py
// builds and registers them; the pure-JAX code they replace stays the reference and the tests
// compare the two).
//
// Why they exist: a decode step at batch 1-16 is a chain of ~200 small dependent matmuls and
// ~60 small attention reads. XLA:CPU runs each matmul through YNNPACK, paying a thread-pool
// hand-off each and streaming the weights well below the memory's speed, and runs decode
// attention as single-threaded multiply-reduce loops over the whole attended-length bucket.
// Here every weight row is read once for all input rows (register tiles), attention reads each
// row's keys and values once up to its own length, and the caller and XLA's intra-op threads
// share the work in chunks. What each choice measured: docs/cpu_kernels.md.
//
// One translation unit (library.py compiles this file): the kernels by concern in the headers
// beside it, and here the XLA FFI handlers that bind them, each run with the XLA thread pool the
// kernels share their chunks out over (`Pooled`, pool.h).
#include "attention.h"
#include "bandwidth.h"
#include "blocks.h"
#include "crossover.h"
#include "experts.h"
#include "int8.h"
#include "layer.h"
#include "layer_lora.h"
#include "matmul.h"
#include "pool.h"
#include "sampling.h"
#include "simd.h"

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_matmul_nt, Pooled<&MatmulNT>::call,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_expert_matmul_nt, Pooled<&ExpertMatmulNT>::call,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_matmul_blocks, Pooled<&MatmulBlocks>::call,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("kind"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_matmul_int8, Pooled<&MatmulInt8>::call,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_history_attention, Pooled<&HistoryAttention>::call,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("page_size")
                                  .Attr<int64_t>("head_stride")
                                  .Attr<int64_t>("page_stride")
                                  .Attr<int64_t>("num_pages"));

// What both layer kernels take after their weights, in their handlers' order.
template <typename Binding>
auto with_rows_and_cache(Binding&& binding) {
  return std::move(binding).template Arg<ffi::Buffer<ffi::F32>>()  // cos
      .template Arg<ffi::Buffer<ffi::F32>>()             // sin
      .template Arg<ffi::AnyBuffer>()                    // cache_k (f32 or f16)
      .template Arg<ffi::AnyBuffer>()                    // cache_v
      .template Arg<ffi::Buffer<ffi::S32>>()             // tables
      .template Arg<ffi::Buffer<ffi::S32>>()             // positions
      .template Arg<ffi::Buffer<ffi::S32>>()             // valid
      .template Ret<ffi::Buffer<ffi::F32>>()             // x_out
      .template Ret<ffi::AnyBuffer>()                    // cache_k (aliased)
      .template Ret<ffi::AnyBuffer>()                    // cache_v (aliased)
      .template Attr<float>("eps")
      .template Attr<float>("scale")
      .template Attr<int64_t>("num_heads")
      .template Attr<int64_t>("num_kv_heads")
      .template Attr<int64_t>("window")
      .template Attr<int64_t>("page_size")
      .template Attr<int64_t>("head_stride")
      .template Attr<int64_t>("page_stride")
      .template Attr<int64_t>("num_pages");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_decoder_layer, Pooled<&DecoderLayer>::call,
                              with_rows_and_cache(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // x
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // attn_norm
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // wq
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // wk
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // wv
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // wo
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // q_norm
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // k_norm
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // mlp_norm
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // w_gate
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // w_up
                                                      .Arg<ffi::Buffer<ffi::F32>>())  // w_down
                                  .Attr<bool>("qk_norm"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_decoder_layer_at, Pooled<&DecoderLayerAt>::call,
                              with_rows_and_cache(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
                                                      .Arg<ffi::Buffer<ffi::F32>>()   // x
                                                      .Arg<ffi::Buffer<ffi::U32>>())  // addresses
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("intermediate")
                                  .Attr<int64_t>("head_dim"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_decoder_layer_at_lora, Pooled<&DecoderLayerAtLora>::call,
                              with_rows_and_cache(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
                                                      .Arg<ffi::Buffer<ffi::F32>>()   // x
                                                      .Arg<ffi::Buffer<ffi::U32>>())  // addresses
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("intermediate")
                                  .Attr<int64_t>("head_dim")
                                  .Arg<ffi::Buffer<ffi::S32>>()  // each row's adapter slot
                                  .Arg<ffi::Buffer<ffi::F32>>()  // the slots' scales
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()   // q: A, B
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()   // k
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()   // v
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()   // o
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()   // gate
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()   // up
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()   // down
                                  .Attr<int64_t>("rank")
                                  .Attr<int64_t>("modules"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_lora_delta, Pooled<&LoraDelta>::call,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::F32>>()   // A pool
                                  .Arg<ffi::Buffer<ffi::F32>>()   // B pool
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scales
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slots
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layer"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_argmax, Pooled<&ArgmaxRows>::call,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>());
