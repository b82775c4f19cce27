/* The random stream of the native samplers: xoshiro256** seeded through splitmix64.
 *
 * The same seed gives the same stream on any thread and any machine; every
 * call of a sampler seeds its own stream, so no state is shared. */
#pragma once

#include <cstdint>

namespace looc {

inline uint64_t splitmix64(uint64_t &x) {
    uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

struct Rng {  // xoshiro256**
    uint64_t s[4];
    explicit Rng(uint64_t seed) {
        uint64_t x = seed;
        for (auto &w : s) w = splitmix64(x);
    }
    inline uint64_t next() {
        const uint64_t result = rotl(s[1] * 5, 7) * 9;
        const uint64_t t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = rotl(s[3], 45);
        return result;
    }
    /* Uniform integer in [0, range), range > 0, without bias (Lemire 2019). */
    inline uint64_t below(uint64_t range) {
        __uint128_t m = (__uint128_t)next() * range;
        uint64_t low = (uint64_t)m;
        if (low < range) {
            const uint64_t threshold = (0 - range) % range;
            while (low < threshold) {
                m = (__uint128_t)next() * range;
                low = (uint64_t)m;
            }
        }
        return (uint64_t)(m >> 64);
    }
};

}  // namespace looc
