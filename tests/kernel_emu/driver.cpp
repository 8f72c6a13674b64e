// Runs one kernel of src/optim/kernels.cu under the host emulation (emu.h).
//
// Usage: driver KERNEL N GRID FILE SCALAR...
//   KERNEL   adamw_f32 | adamw8bit_f32 | adamw8bit_q8 | lion_f32 | lion_q8 (f32 parameters)
//   N        elements; GRID: CUDA blocks (of 256 threads)
//   FILE     the kernel's buffers in argument order, raw little-endian, rewritten in place after
//            the launch: p f32[N], g f32[N], then the state (f32[N] moments, or u8[N] codes and
//            f32[ceil(N/256)] absmax per moment), then for _q8 the maps f32[512] (signed, then
//            unsigned; lion reads the signed one), as the CUDA path passes them
//   SCALAR   the kernel's float arguments in order, each as its 32 bits in hex
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "kernels.cu"

namespace {

struct Buffers {
  std::vector<char> bytes;
  size_t at = 0;
  template <class T>
  T* take(size_t count) {
    T* p = reinterpret_cast<T*>(bytes.data() + at);
    at += count * sizeof(T);
    if (at > bytes.size()) {
      std::fprintf(stderr, "driver: input file too short\n");
      std::exit(2);
    }
    return p;
  }
};

float scalar(const char* hex) {
  uint32_t bits = (uint32_t)std::strtoul(hex, nullptr, 16);
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: driver KERNEL N GRID FILE SCALAR...\n");
    return 2;
  }
  const std::string kernel = argv[1];
  const u64 n = std::strtoull(argv[2], nullptr, 10);
  const unsigned grid = (unsigned)std::strtoul(argv[3], nullptr, 10);
  const char* path = argv[4];
  float s[8] = {0};
  for (int k = 5; k < argc && k - 5 < 8; ++k) s[k - 5] = scalar(argv[k]);
  const u64 nb = (n + QBLOCK - 1) / QBLOCK;

  Buffers buf;
  FILE* f = std::fopen(path, "rb");
  if (!f) return 3;
  std::fseek(f, 0, SEEK_END);
  buf.bytes.resize((size_t)std::ftell(f));
  std::fseek(f, 0, SEEK_SET);
  if (std::fread(buf.bytes.data(), 1, buf.bytes.size(), f) != buf.bytes.size()) return 3;
  std::fclose(f);

  float* p = buf.take<float>(n);
  const float* g = buf.take<float>(n);
  if (kernel == "adamw_f32") {
    float* m = buf.take<float>(n);
    float* v = buf.take<float>(n);
    emu_launch(grid, QBLOCK, [&] {
      adamw_f32_f32(p, g, m, v, s[0], s[1], s[2], s[3], s[4], s[5], s[6], n);
    });
  } else if (kernel == "adamw8bit_f32") {
    float* m = buf.take<float>(n);
    float* v = buf.take<float>(n);
    emu_launch(grid, QBLOCK,
               [&] { adamw8bit_f32_f32(p, g, m, v, s[0], s[1], s[2], s[3], s[4], n); });
  } else if (kernel == "adamw8bit_q8") {
    u8* c1 = buf.take<u8>(n);
    float* a1 = buf.take<float>(nb);
    u8* c2 = buf.take<u8>(n);
    float* a2 = buf.take<float>(nb);
    const float* maps = buf.take<float>(512);
    emu_launch(grid, QBLOCK, [&] {
      adamw8bit_q8_f32(p, g, c1, a1, c2, a2, maps, s[0], s[1], s[2], s[3], s[4], n);
    });
  } else if (kernel == "lion_f32") {
    float* m = buf.take<float>(n);
    emu_launch(grid, QBLOCK, [&] { lion_f32_f32(p, g, m, s[0], s[1], s[2], s[3], n); });
  } else if (kernel == "lion_q8") {
    u8* c1 = buf.take<u8>(n);
    float* a1 = buf.take<float>(nb);
    const float* maps = buf.take<float>(512);
    emu_launch(grid, QBLOCK,
               [&] { lion_q8_f32(p, g, c1, a1, maps, s[0], s[1], s[2], s[3], n); });
  } else {
    std::fprintf(stderr, "driver: unknown kernel %s\n", kernel.c_str());
    return 2;
  }
  if (buf.at != buf.bytes.size()) {
    std::fprintf(stderr, "driver: input file has %zu bytes, the kernel took %zu\n",
                 buf.bytes.size(), buf.at);
    return 2;
  }
  f = std::fopen(path, "wb");
  if (!f || std::fwrite(buf.bytes.data(), 1, buf.bytes.size(), f) != buf.bytes.size()) return 3;
  std::fclose(f);
  return 0;
}
