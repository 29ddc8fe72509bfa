// The oneDNN engine and per-thread stream every CPU primitive runs on (convolutions, pooling,
// compiled graphs' prepacked GEMMs).
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

namespace kiln::cpu::onednn {

dnnl::engine& cpu_engine();
// This thread's stream on cpu_engine() (a CPU stream runs a primitive in the calling thread).
dnnl::stream& thread_stream();

}  // namespace kiln::cpu::onednn
