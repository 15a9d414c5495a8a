// Host-side fp16/bf16 <-> fp32 conversions (round to nearest even) and typed
// element access, for the CPU reference handlers.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "jax_cluster/types.h"

namespace jax_cluster::cpu {

// The float whose IEEE bits are `bits`, and back (std::bit_cast before C++20).
inline float float_from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint32_t bits_of_float(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

inline float bf16_to_float(uint16_t h) { return float_from_bits(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t bits = bits_of_float(f);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  return float_from_bits(bits);
}

inline uint16_t float_to_half(float f) {
  const uint32_t bits = bits_of_float(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u) return sign | (abs > 0x7F800000u ? 0x7E00 : 0x7C00);
  if (abs >= 0x477FF000u) return sign | 0x7C00;  // rounds to infinity
  if (abs < 0x38800000u) {                        // subnormal or zero in fp16
    if (abs < 0x33000000u) return sign;
    const uint32_t exp = abs >> 23, mant = (abs & 0x7FFFFF) | 0x800000;
    const int shift = 126 - static_cast<int>(exp);  // 14 + (113 - exp) - 1
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xFFF + ((r >> 13) & 1);
  return sign | static_cast<uint16_t>(r >> 13);
}

inline float load(DType t, const void* base, int64_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kF16: return half_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.f;
}

inline void store(DType t, void* base, int64_t i, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(base)[i] = v; break;
    case DType::kF16: static_cast<uint16_t*>(base)[i] = float_to_half(v); break;
    case DType::kBF16: static_cast<uint16_t*>(base)[i] = float_to_bf16(v); break;
  }
}

// Rounds a float to the precision of dtype t (what storing and reloading does).
inline float round_to(DType t, float v) {
  switch (t) {
    case DType::kF32: return v;
    case DType::kF16: return half_to_float(float_to_half(v));
    case DType::kBF16: return bf16_to_float(float_to_bf16(v));
  }
  return v;
}

}  // namespace jax_cluster::cpu
