// The generic driver that runs one entry point of a .cu file under the emulation (emu.h).
// src/kernel_emu.rs generates, per .cu file, a source that includes the .cu file and this header
// and lists the file's `extern "C" __global__` entry points:
//
//   static const EmuEntry EMU_ENTRIES[] = {{"name", &emu_call<&name>}, ...};
//   int main(int argc, char** argv) { return emu_main(argc, argv, EMU_ENTRIES, N); }
//
// Usage: driver ENTRY GX GY GZ BX BY BZ FILE ARG...
//   FILE holds the kernel's buffers back to back; it is rewritten with their contents after the
//   launch. Each ARG is one kernel parameter, in order:
//     b:BYTES   a pointer: the next BYTES bytes of FILE
//     f:HEX     a float, as its 32 bits in hex
//     i:DEC     any integer type
//   The parameter kinds are checked against the entry point's signature.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

// Bytes after each buffer that a kernel must leave alone (checked after the launch).
constexpr size_t EMU_GUARD = 64;
constexpr char EMU_GUARD_BYTE = (char)0xa5;

struct EmuArgs {
  std::vector<std::vector<char>> buffers;  // each: its bytes, then EMU_GUARD guard bytes
  std::vector<std::string> tokens;
  size_t next_token = 0, next_buffer = 0;
  bool failed = false;

  const char* take(char kind, const char* what) {
    if (next_token >= tokens.size()) {
      std::fprintf(stderr, "driver: too few arguments (parameter %zu is a %s)\n", next_token,
                   what);
      failed = true;
      return nullptr;
    }
    const std::string& t = tokens[next_token++];
    if (t.size() < 2 || t[0] != kind || t[1] != ':') {
      std::fprintf(stderr, "driver: parameter %zu is a %s, got argument '%s'\n", next_token - 1,
                   what, t.c_str());
      failed = true;
      return nullptr;
    }
    return t.c_str() + 2;
  }

  template <class T>
  T next() {
    if constexpr (std::is_pointer_v<T>) {
      if (!take('b', "pointer") || next_buffer >= buffers.size()) {
        failed = true;
        return nullptr;
      }
      return reinterpret_cast<T>(buffers[next_buffer++].data());
    } else if constexpr (std::is_floating_point_v<T>) {
      const char* v = take('f', "float");
      if (!v) return T{};
      uint32_t bits = (uint32_t)std::strtoul(v, nullptr, 16);
      float x;
      std::memcpy(&x, &bits, sizeof x);
      return (T)x;
    } else {
      static_assert(std::is_integral_v<T>, "kernel parameters are pointers, floats or integers");
      const char* v = take('i', "integer");
      if (!v) return T{};
      return (T)std::strtoll(v, nullptr, 10);
    }
  }
};

struct EmuLaunch {
  dim3 grid, block;
};

using EmuCall = int (*)(EmuArgs&, EmuLaunch);

template <class... A>
int emu_invoke(void (*f)(A...), EmuArgs& args, EmuLaunch l) {
  // A braced list evaluates left to right, so parameters take their arguments in order.
  std::tuple<A...> vals{args.template next<A>()...};
  if (args.failed) return 2;
  if (args.next_token != args.tokens.size()) {
    std::fprintf(stderr, "driver: %zu arguments for %zu parameters\n", args.tokens.size(),
                 args.next_token);
    return 2;
  }
  emu_launch(l.grid, l.block, [&] { std::apply(f, vals); });
  return 0;
}

template <auto F>
int emu_call(EmuArgs& args, EmuLaunch l) {
  return emu_invoke(F, args, l);
}

struct EmuEntry {
  const char* name;
  EmuCall call;
};

inline int emu_main(int argc, char** argv, const EmuEntry* entries, size_t n_entries) {
  if (argc < 9) {
    std::fprintf(stderr, "usage: driver ENTRY GX GY GZ BX BY BZ FILE ARG...\n");
    return 2;
  }
  const std::string name = argv[1];
  auto u = [&](int i) { return (unsigned)std::strtoul(argv[i], nullptr, 10); };
  EmuLaunch l{dim3(u(2), u(3), u(4)), dim3(u(5), u(6), u(7))};
  const char* path = argv[8];
  EmuArgs args;
  for (int k = 9; k < argc; ++k) args.tokens.emplace_back(argv[k]);

  std::vector<char> bytes;
  FILE* f = std::fopen(path, "rb");
  if (!f) return 3;
  std::fseek(f, 0, SEEK_END);
  bytes.resize((size_t)std::ftell(f));
  std::fseek(f, 0, SEEK_SET);
  if (std::fread(bytes.data(), 1, bytes.size(), f) != bytes.size()) return 3;
  std::fclose(f);
  size_t at = 0;
  for (const auto& t : args.tokens) {
    if (t.rfind("b:", 0) != 0) continue;
    const size_t len = std::strtoull(t.c_str() + 2, nullptr, 10);
    if (at + len > bytes.size()) {
      std::fprintf(stderr, "driver: FILE has %zu bytes, the buffers %zu or more\n", bytes.size(),
                   at + len);
      return 2;
    }
    // Each buffer in its own allocation, followed by guard bytes.
    std::vector<char> b(len + EMU_GUARD, EMU_GUARD_BYTE);
    std::memcpy(b.data(), bytes.data() + at, len);
    args.buffers.push_back(std::move(b));
    at += len;
  }
  if (at != bytes.size()) {
    std::fprintf(stderr, "driver: FILE has %zu bytes, the buffers %zu\n", bytes.size(), at);
    return 2;
  }

  const EmuEntry* e = nullptr;
  for (size_t i = 0; i < n_entries; ++i)
    if (name == entries[i].name) e = &entries[i];
  if (!e) {
    std::fprintf(stderr, "driver: no entry point %s\n", name.c_str());
    return 2;
  }
  if (const int rc = e->call(args, l)) return rc;

  at = 0;
  for (size_t k = 0; k < args.buffers.size(); ++k) {
    const auto& b = args.buffers[k];
    const size_t len = b.size() - EMU_GUARD;
    for (size_t j = len; j < b.size(); ++j) {
      if (b[j] != EMU_GUARD_BYTE) {
        std::fprintf(stderr, "driver: %s wrote past the end of buffer %zu (%zu bytes)\n",
                     name.c_str(), k, len);
        return 5;
      }
    }
    std::memcpy(bytes.data() + at, b.data(), len);
    at += len;
  }
  f = std::fopen(path, "wb");
  if (!f || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) return 3;
  std::fclose(f);
  return 0;
}
