// Calls sbd::mask_scatter_ from C++ through the PyTorch dispatcher, as an inference engine written against
// libtorch would, and checks the result of one EB acceptance step (docs/algorithm.md §3.5).
//
// Block of K = 4 positions, all masked, entropies {0.05, 0.30, 0.02, 0.90}, gamma = 0.1.
// Ranked by entropy: positions 2 (0.02), 0 (0.05), 1 (0.30), 3 (0.90). Sums of the entropies ranked before
// each: 0, 0.02, 0.07, 0.37, so positions 2, 0 and 1 are accepted (0.07 <= 0.1) and 3 is not (0.37 > 0.1).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <iostream>

int main() {
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("sbd::mask_scatter_", "");

  at::Tensor block_tokens = at::full({1, 4}, -1, at::kLong);
  at::Tensor is_masked = at::ones({1, 4}, at::kBool);
  at::Tensor sampled = at::arange(10, 14, at::kLong).reshape({1, 4});
  at::Tensor entropy = at::tensor({0.05f, 0.30f, 0.02f, 0.90f}).reshape({1, 4});

  // Boxed call: arguments in schema order (block_tokens, is_masked, sampled, entropy, gamma, gamma_val,
  // rule, valid).
  torch::jit::Stack stack{block_tokens, is_masked, sampled, entropy, c10::IValue(), 0.1,
                          std::string("eb"), c10::IValue()};
  op.callBoxed(&stack);
  const at::Tensor accepted = stack[0].toTensor();
  const at::Tensor num_accepted = stack[1].toTensor();
  const at::Tensor block_done = stack[2].toTensor();

  const at::Tensor expected_tokens = at::tensor({10L, 11L, 12L, -1L}).reshape({1, 4});
  const at::Tensor expected_accepted = at::tensor({1, 1, 1, 0}).reshape({1, 4}).to(at::kBool);
  const bool ok = at::equal(block_tokens, expected_tokens) && at::equal(accepted, expected_accepted) &&
                  at::equal(is_masked, expected_accepted.logical_not()) &&
                  num_accepted.item<int>() == 3 && !block_done.item<bool>();
  std::cout << "block_tokens " << block_tokens << "\naccepted " << accepted << "\nnum_accepted "
            << num_accepted << "\nblock_done " << block_done << "\n"
            << (ok ? "mask_scatter_ from C++: OK" : "mask_scatter_ from C++: WRONG RESULT") << std::endl;
  return ok ? 0 : 1;
}
