// Runs a saved TorchScript module that calls the flashattn_ext ops, from C++ alone
// (no Python): the deployment path of a model traced or scripted in Python.
//
//   run_traced_module MODULE INPUTS OUTPUT
//
// MODULE  a module saved with torch.jit.save (e.g. of torch.jit.trace of a model that
//         calls flashattn_ext.flash_attn_func: its graph holds flashattn_ext:: ops);
// INPUTS  the arguments of its forward, a tuple of tensors saved with torch.save;
// OUTPUT  what forward returns, written with torch::jit::pickle_save (torch.load reads it).
//
// Nothing here names the ops: the module resolves them through the dispatcher, where
// libflashattn_ext registered them when it was loaded. That is why the program links
// the library although it uses no symbol of it (see CMakeLists.txt: --no-as-needed).
#include <torch/script.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

namespace {

std::vector<char> read_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw std::runtime_error("cannot open " + path);
  return {std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
}

void write_file(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream file(path, std::ios::binary);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!file) throw std::runtime_error("cannot write " + path);
}

// forward's arguments: the elements of the saved tuple (a single saved tensor is one argument).
std::vector<torch::jit::IValue> forward_arguments(const torch::jit::IValue& saved) {
  if (saved.isTuple()) return saved.toTupleRef().elements().vec();
  if (saved.isList()) return saved.toListRef().vec();
  return {saved};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: " << argv[0] << " MODULE INPUTS OUTPUT\n";
    return EXIT_FAILURE;
  }
  try {
    torch::jit::Module module = torch::jit::load(argv[1]);
    module.eval();
    const std::vector<torch::jit::IValue> inputs =
        forward_arguments(torch::jit::pickle_load(read_file(argv[2])));
    const torch::NoGradGuard no_grad;
    const torch::jit::IValue output = module.forward(inputs);
    write_file(argv[3], torch::jit::pickle_save(output));
    if (output.isTensor()) {
      const at::Tensor& out = output.toTensor();
      std::cout << "output " << out.sizes() << " " << out.scalar_type() << ", sum "
                << out.sum().item<double>() << "\n";
    }
  } catch (const std::exception& error) {
    std::cerr << "run_traced_module: " << error.what() << "\n";
    return EXIT_FAILURE;
  }
  return EXIT_SUCCESS;
}
