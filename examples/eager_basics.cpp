// Eager basics: creating tensors, arithmetic with broadcasting and type promotion, views that
// share memory, reductions, matmul, and the errors Kiln raises for bad input.
#include <kiln/kiln.h>

#include "example.h"

using namespace kiln;

KILN_EXAMPLE(eager_basics, 10, "Eager basics: tensors, views, broadcasting, errors") {
  // Factories and printing, in PyTorch's format.
  Tensor x = ones({3});
  out << x << "\n";
  Tensor a = arange(6, kFloat32).view({2, 3});
  out << a << "\n";

  // Arithmetic broadcasts: (2, 3) + (3,) -> (2, 3).
  Tensor b = tensor<float>({10, 20, 30});
  out << a + b << "\n";

  // Type promotion follows PyTorch: int64 tensor * 2.5 -> float32; int64 * 2 stays int64.
  Tensor i = arange(3);
  out << i * 2.5 << "\n" << i * 2 << "\n";

  // Views share storage: writing through the transpose changes `a`.
  Tensor at = a.t();
  at.select(0, 0).fill_(-1);
  out << a << "\n";

  // Reductions and matmul.
  out << a.sum() << "\n" << a.sum({1}) << "\n" << a.mean({0}, /*keepdim=*/true) << "\n";
  out << matmul(a, a.t()) << "\n";

  // Bad input throws kiln::Error subclasses with messages that say what to do.
  try {
    matmul(ones({2, 3}), ones({4, 5}));
  } catch (const ShapeError& e) {
    out << "ShapeError: " << e.what() << "\n";
  }
}
