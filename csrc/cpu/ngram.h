// Prompt lookup for n-gram speculative decoding (pyserve/engine/ngram.py).
#pragma once

#include <cstdint>
#include <utility>

namespace pyserve::cpu {

// The most recent earlier place of the longest suffix of `tokens[0, size)` that is between
// min_n and max_n tokens long and ends before the last token, looking only at the last
// `window` tokens: {the index just past that earlier place (where the proposal starts), the
// suffix's length}, or {-1, 0} when no suffix of at least min_n tokens recurs.
std::pair<int64_t, int64_t> ngram_match(const int64_t* tokens, int64_t size, int64_t min_n,
                                        int64_t max_n, int64_t window);

}  // namespace pyserve::cpu
