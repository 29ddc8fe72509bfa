// See onednn.h.
#include "kernels/cpu/onednn.h"

namespace kiln::cpu::onednn {

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::stream& thread_stream() {
  thread_local dnnl::stream stream(cpu_engine());
  return stream;
}

}  // namespace kiln::cpu::onednn
