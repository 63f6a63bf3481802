// Prompt lookup (n-gram) proposals for speculative decoding, one call for the whole batch.
//
// For each i < count, tokens[rows[i] * stride .. + lens[i]) is one request's context (prompt +
// output): the persistent batch's token array is read in place.
// The proposal is the up to k tokens that followed the earliest earlier occurrence of the
// longest suffix of the context of length in [min_n, max_n] (vLLM's NgramProposer rule), at
// most max_len - lens[i] tokens (the model's length bound). Written to out[i * k ..], the count
// to counts[i] (0: no proposal).
//
// The search runs KMP over the reversed context: the pattern is its own prefix (the context's
// suffix, reversed), and a match ending at reversed index p of length L is an occurrence of the
// length-L suffix starting at original index len - 1 - p. Matches are capped at max_n (the
// automaton steps back through the prefix function there), so the whole row is one O(len) pass.
#include <stdint.h>

static int32_t propose_row(const int32_t* t, int32_t n, int32_t min_n, int32_t max_n, int32_t k,
                           int32_t max_len, int32_t* out, int32_t* lps) {
  if (n < min_n) return 0;
  if (k > max_len - n) k = max_len - n;
  if (k <= 0) return 0;
#define REV(i) t[n - 1 - (i)]
  int32_t longest = 0, position = 0, prev = 0;
  for (int32_t i = 0; i < max_n; ++i) lps[i] = 0;
  int32_t i = 1;
  while (i < n) {
    if (REV(prev) == REV(i)) {
      ++prev;
      if (prev >= longest) {  // >=: the largest p, i.e. the earliest occurrence in the context
        longest = prev;
        position = i;
      }
      if (i < max_n) lps[i] = prev;
      if (prev == max_n) prev = lps[max_n - 1];
      ++i;
    } else if (prev != 0) {
      prev = lps[prev - 1];
    } else {
      ++i;
    }
  }
#undef REV
  if (longest < min_n) return 0;
  const int32_t start = n - 1 - position + longest;
  int32_t count = n - start;
  if (count > k) count = k;
  for (int32_t j = 0; j < count; ++j) out[j] = t[start + j];
  return count;
}

void ngram_propose(const int32_t* tokens, int64_t stride, const int64_t* rows,
                   const int32_t* lens, int32_t count, int32_t min_n, int32_t max_n, int32_t k,
                   int32_t max_len, int32_t* out, int32_t* counts) {
#pragma omp parallel for schedule(dynamic, 8) if (count >= 64)
  for (int32_t i = 0; i < count; ++i) {
    int32_t lps[max_n];
    counts[i] = propose_row(tokens + rows[i] * stride, lens[i], min_n, max_n, k, max_len,
                            out + (int64_t)i * k, lps);
  }
}
