#include <kiln/kiln.h>

#include <iostream>

int main() {
  kiln::Tensor x = kiln::ones({2, 2});
  std::cout << (x + x).sum().item<float>() << "\n";  // 8
  return 0;
}
