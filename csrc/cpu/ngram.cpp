// One backward pass over the history: every earlier place of the last token is a candidate,
// extended backwards while it matches the suffix, up to max_n. The scan starts at the most
// recent place and keeps a candidate only when it is strictly longer than the best so far, so
// among the longest matches the most recent wins (the numpy version's choice; vLLM's proposer
// takes the earliest, which changes drafts, never outputs: drafts are verified); a match of
// max_n tokens ends the scan. The numpy version it replaces took 34 µs a step at 300
// tokens of history, a comparison pass and a few gathers each paying numpy's call overhead;
// this pass reads 8 bytes a token, about a microsecond at that length.
#include "cpu/ngram.h"

#include <algorithm>

namespace pyserve::cpu {

std::pair<int64_t, int64_t> ngram_match(const int64_t* tokens, int64_t size, int64_t min_n,
                                        int64_t max_n, int64_t window) {
  const int64_t lo = std::max<int64_t>(0, size - window);
  // a match ends at most at size - 2, so it is at most size - 1 - lo tokens long
  max_n = std::min(max_n, size - 1 - lo);
  min_n = std::max<int64_t>(min_n, 1);
  if (max_n < min_n) return {-1, 0};
  const int64_t last = size - 1;
  int64_t best_n = 0, best_end = -1;
  for (int64_t end = last - 1; end >= lo; --end) {
    if (tokens[end] != tokens[last]) continue;
    int64_t n = 1;
    while (n < max_n && end - n >= lo && tokens[end - n] == tokens[last - n]) ++n;
    if (n > best_n) {
      best_n = n;
      best_end = end;
      if (n == max_n) break;
    }
  }
  if (best_n < min_n) return {-1, 0};
  return {best_end + 1, best_n};
}

}  // namespace pyserve::cpu
