#include <kiln/kiln.h>

#include <iostream>

int main() {
  using namespace kiln;
  Tensor x = ones({2, 2});
  std::cout << (x + x).sum().item<float>() << "\n";  // 8
  // The kiln backend builds a C++ kernel for this at the first call: against the headers the
  // library carries, so an installed (even moved) Kiln needs nothing from its source tree.
  auto f = compile([](const Tensor& a) { return (a * 2 + 1).relu().sum(); });
  const auto before = compiler::counters();
  const float y = f(x).item<float>();
  const bool generated = compiler::counters().kernel_runs > before.kernel_runs;
  std::cout << y << (generated ? " generated" : " not generated") << "\n";  // 12 generated
  return 0;
}
