// Tensor's autograd methods.
#include "autograd/node.h"
#include "kiln/ops.h"

namespace kiln {

using autograd::meta;
using autograd::meta_if_exists;

Tensor Tensor::grad() const {
  auto* m = meta_if_exists(*this);
  return m ? m->grad : Tensor();
}

void Tensor::set_grad(const Tensor& g) const {
  if (g.defined()) {
    KILN_CHECK(g.sizes() == sizes(), ShapeError,
               "[kiln::set_grad] assigned grad has shape " + shape_str(g.sizes()) +
                   " but the tensor has shape " + shape_str(sizes()) + ".");
    KILN_CHECK(g.dtype() == dtype() && g.device() == device(), DTypeError,
               "[kiln::set_grad] assigned grad must have the tensor's dtype and device.");
  }
  meta(*this).grad = g;
}

bool Tensor::is_leaf() const {
  auto* m = meta_if_exists(*this);
  return !m || !m->grad_fn;
}

std::shared_ptr<autograd::Node> Tensor::grad_fn() const {
  auto* m = meta_if_exists(*this);
  return m ? m->grad_fn : nullptr;
}

std::string Tensor::grad_fn_name() const {
  auto fn = grad_fn();
  return fn ? fn->name() : "";
}

void Tensor::retain_grad() const {
  KILN_CHECK(requires_grad(), Error,
             "[kiln::retain_grad] can't retain_grad on a tensor that has requires_grad=false.");
  auto& m = meta(*this);
  if (!m.grad_fn || m.retains_grad) return;  // leaves always keep their grad
  m.retains_grad = true;
  m.grad_fn->retained[m.output_nr] = impl_ptr();
}

bool Tensor::retains_grad() const {
  auto* m = meta_if_exists(*this);
  return m && m->retains_grad;
}

void Tensor::register_hook(std::function<Tensor(const Tensor&)> hook) const {
  KILN_CHECK(requires_grad(), Error,
             "[kiln::register_hook] cannot register a hook on a tensor that doesn't require gradient.");
  auto& m = meta(*this);
  if (m.grad_fn) m.grad_fn->pre_hooks[m.output_nr].push_back(std::move(hook));
  else m.hooks.push_back(std::move(hook));
}


void Tensor::backward(const Tensor& gradient, std::optional<bool> retain_graph, bool create_graph) const {
  autograd::backward({*this}, {gradient}, retain_graph, create_graph);
}

}  // namespace kiln
