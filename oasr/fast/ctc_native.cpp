// The fast CTC search's native CPU path: the host loop (oasr/fast/ctc_search.py, _advance_host) in C++.
//
// One call decodes a whole cohort's chunk: every row, every frame, reading each row's beam from its
// state buffers (the layout of oasr/fast/ctc_decoder.py) and, only when no row's prefix outgrew
// max_prefix_len, writing every row back. The rule is the host loop's, step for step: per frame the
// entries in generation order (prefix i stays, then prefix i + cands[k] for k ascending; a child that
// equals a beam prefix merges with that prefix's stay entry, at the earlier position), the score
// log(exp(stay_pb) + exp(pnb)), the emission frame (the stay's when its total is >= the extension's),
// and the new beam the beam_size best by (score desc, generation order asc). Arithmetic in double with
// the same libm calls as Python's math module (exp, log1p), so the results equal the host loop's bit
// for bit. Built with g++ by oasr/fast/ctc_native.py; plain C ABI, no torch headers.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

const double NEG_INF = -INFINITY;
const int64_t HASH_MOD = 2147483647LL;  // 2^31 - 1
const int64_t HASH_MUL0 = 911382323LL, HASH_MUL1 = 972663749LL;

inline double logaddexp(double a, double b) {
  if (a == NEG_INF) return b;
  if (b == NEG_INF) return a;
  return (a > b ? a : b) + std::log1p(std::exp(-std::fabs(a - b)));
}

inline int64_t extend_key(int64_t key, int64_t token) {
  int64_t c = token + 1;
  int64_t h1 = ((key >> 31) * HASH_MUL0 + c) % HASH_MOD;
  int64_t h2 = ((key & HASH_MOD) * HASH_MUL1 + c) % HASH_MOD;
  return (h1 << 31) | h2;
}

struct Prefix {
  std::vector<int32_t> tokens, frames;
  double pb, pnb;
  int64_t key, parent_key;
};

struct Entry {
  int stay;  // beam index whose stay fills this entry, -1 if none
  int ext;   // beam index extended into this entry, -1 if none
  int32_t token;  // the extension's token
  double stay_pb, stay_pnb, ext_pnb;
  int64_t key, parent_key;
};

// Buffer pointers of one row (its state's buffers offset to the row): tokens, frames (W x L int32),
// lengths, keys, parent_keys, last (W int64), log_pb, log_pnb (W double).
struct RowPtrs {
  int32_t* tokens;
  int32_t* frames;
  int64_t* lengths;
  int64_t* keys;
  int64_t* parent_keys;
  int64_t* last;
  double* log_pb;
  double* log_pnb;
};

RowPtrs row_ptrs(const int64_t* p) {
  return RowPtrs{reinterpret_cast<int32_t*>(p[0]), reinterpret_cast<int32_t*>(p[1]),
                 reinterpret_cast<int64_t*>(p[2]), reinterpret_cast<int64_t*>(p[3]),
                 reinterpret_cast<int64_t*>(p[4]), reinterpret_cast<int64_t*>(p[5]),
                 reinterpret_cast<double*>(p[6]),  reinterpret_cast<double*>(p[7])};
}

void read_row(const RowPtrs& r, int W, int L, std::vector<Prefix>& beam) {
  beam.clear();
  for (int w = 0; w < W; ++w) {
    double pb = r.log_pb[w], pnb = r.log_pnb[w];
    if (!(logaddexp(pb, pnb) > NEG_INF)) continue;
    int64_t n = r.lengths[w];
    Prefix p;
    p.tokens.assign(r.tokens + (int64_t)w * L, r.tokens + (int64_t)w * L + n);
    p.frames.assign(r.frames + (int64_t)w * L, r.frames + (int64_t)w * L + n);
    p.pb = pb;
    p.pnb = pnb;
    p.key = r.keys[w];
    p.parent_key = r.parent_keys[w];
    beam.push_back(std::move(p));
  }
}

// One frame of one row: _advance_host.
void advance(std::vector<Prefix>& beam, std::vector<Prefix>& next, std::vector<Entry>& entries,
             const double* lp_row, double lp_blank, const int64_t* cands, const double* lp_cands, int K,
             int32_t frame, int W) {
  const int n = (int)beam.size();
  // child_of[i * K + k]: the beam index j whose tokens are beam[i] + cands[k], else -1
  int child_of_buf[64 * 8];
  std::vector<int> child_heap;
  int* child_of = child_of_buf;
  if (n * K > 64 * 8) {
    child_heap.assign((size_t)n * K, -1);
    child_of = child_heap.data();
  } else {
    for (int x = 0; x < n * K; ++x) child_of[x] = -1;
  }
  for (int j = 0; j < n; ++j) {
    const Prefix& c = beam[j];
    if (c.tokens.empty()) continue;
    const size_t m = c.tokens.size() - 1;
    const int32_t tok = c.tokens.back();
    for (int i = 0; i < n; ++i) {
      const Prefix& p = beam[i];
      if (p.tokens.size() != m || p.key != c.parent_key) continue;
      if (m && std::memcmp(p.tokens.data(), c.tokens.data(), m * sizeof(int32_t)) != 0) continue;
      for (int k = 0; k < K; ++k)
        if (cands[k] == tok) child_of[i * K + k] = j;
      break;  // distinct beam prefixes: one parent at most
    }
  }
  std::vector<int> entry_of(n, -1);  // the entry holding beam[j]'s tokens
  entries.clear();
  auto new_entry = [&](int64_t key, int64_t parent_key) {
    entries.push_back(Entry{-1, -1, -1, NEG_INF, NEG_INF, NEG_INF, key, parent_key});
    return (int)entries.size() - 1;
  };
  for (int i = 0; i < n; ++i) {
    const Prefix& p = beam[i];
    const double score = logaddexp(p.pb, p.pnb);
    const int64_t last = p.tokens.empty() ? -1 : p.tokens.back();
    const double stay_pb = score + lp_blank;
    const double stay_pnb = p.tokens.empty() ? NEG_INF : p.pnb + lp_row[last];
    if (logaddexp(stay_pb, stay_pnb) > NEG_INF) {
      int e = entry_of[i];
      if (e < 0) e = entry_of[i] = new_entry(p.key, p.parent_key);
      entries[e].stay = i;
      entries[e].stay_pb = stay_pb;
      entries[e].stay_pnb = stay_pnb;
    }
    for (int k = 0; k < K; ++k) {
      const int64_t c = cands[k];
      const double ext_pnb = (c == last ? p.pb : score) + lp_cands[k];
      if (ext_pnb == NEG_INF) continue;
      const int j = child_of[i * K + k];
      int e = j >= 0 ? entry_of[j] : -1;
      if (e < 0) {
        e = new_entry(extend_key(p.key, c), p.key);
        if (j >= 0) entry_of[j] = e;
      }
      entries[e].ext = i;
      entries[e].token = (int32_t)c;
      entries[e].ext_pnb = ext_pnb;
    }
  }
  // the W best by (score desc, generation order asc): an insertion into a short sorted list
  int best[64];
  double best_score[64];
  int kept = 0;
  const int cap = W < 64 ? W : 64;
  std::vector<double> pnbs(entries.size());
  for (int e = 0; e < (int)entries.size(); ++e) {
    const Entry& x = entries[e];
    const double pnb = logaddexp(x.stay_pnb, x.ext_pnb);
    const double score = logaddexp(x.stay_pb, pnb);
    pnbs[e] = pnb;
    if (score == NEG_INF) continue;
    if (kept == cap && !(score > best_score[kept - 1])) continue;
    int pos = kept < cap ? kept++ : kept - 1;
    while (pos > 0 && score > best_score[pos - 1]) {
      best[pos] = best[pos - 1];
      best_score[pos] = best_score[pos - 1];
      --pos;
    }
    best[pos] = e;
    best_score[pos] = score;
  }
  next.resize(kept);
  for (int r = 0; r < kept; ++r) {
    const Entry& x = entries[best[r]];
    Prefix& out = next[r];
    const bool keep_stay = x.stay >= 0 && (x.ext < 0 || logaddexp(x.stay_pb, x.stay_pnb) >= x.ext_pnb);
    if (x.stay >= 0) {
      out.tokens = beam[x.stay].tokens;
    } else {
      out.tokens = beam[x.ext].tokens;
      out.tokens.push_back(x.token);
    }
    if (keep_stay) {
      out.frames = beam[x.stay].frames;
    } else {
      out.frames = beam[x.ext].frames;
      out.frames.push_back(frame);
    }
    out.pb = x.stay_pb;
    out.pnb = pnbs[best[r]];
    out.key = x.key;
    out.parent_key = x.parent_key;
  }
}

void write_row(const RowPtrs& r, int W, int L, const std::vector<Prefix>& beam, int64_t old_window) {
  for (int w = 0; w < W; ++w) {
    int32_t* tok = r.tokens + (int64_t)w * L;
    int32_t* frm = r.frames + (int64_t)w * L;
    int64_t n = 0;
    if (w < (int)beam.size()) {
      const Prefix& p = beam[w];
      n = (int64_t)p.tokens.size();
      std::memcpy(tok, p.tokens.data(), n * sizeof(int32_t));
      std::memcpy(frm, p.frames.data(), n * sizeof(int32_t));
      r.lengths[w] = n;
      r.keys[w] = p.key;
      r.parent_keys[w] = p.parent_key;
      r.last[w] = n ? p.tokens.back() : -1;
      r.log_pb[w] = p.pb;
      r.log_pnb[w] = p.pnb;
    } else {  // dead slot: the empty, all-padding record
      r.lengths[w] = 0;
      r.keys[w] = 0;
      r.parent_keys[w] = -1;
      r.last[w] = -1;
      r.log_pb[w] = NEG_INF;
      r.log_pnb[w] = NEG_INF;
    }
    for (int64_t x = n; x < old_window; ++x) {
      tok[x] = -1;
      frm[x] = -1;
    }
  }
}

}  // namespace

extern "C" {

// Decode one chunk for R rows. ptrs (R, 8): each row's buffer pointers (RowPtrs order); old_window (R,):
// the row's state's longest prefix before the call (positions from there on are padding); first_frame,
// row_len (R,); lp (R, T, V) double; lp_blank (R, T) double; cands (R, T, K) int64 ascending; lp_cands
// (R, T, K) double (-inf: no extension). W = beam_size, L = max_prefix_len (the buffers' width).
// Returns 0 and writes every row back, with longest_out (R,) each row's longest prefix, or returns 1 (a
// prefix would hold more than L tokens) and writes nothing.
int oasr_ctc_decode_rows(int R, int T, int V, int K, int W, int L, const int64_t* ptrs, const int64_t* old_window,
                         const int64_t* first_frame, const int64_t* row_len, const double* lp, const double* lp_blank,
                         const int64_t* cands, const double* lp_cands, int64_t* longest_out) {
  std::vector<std::vector<Prefix>> rows(R);
  std::vector<Prefix> next;
  std::vector<Entry> entries;
  entries.reserve((size_t)W * (1 + K));
  for (int r = 0; r < R; ++r) {
    std::vector<Prefix>& beam = rows[r];
    read_row(row_ptrs(ptrs + 8 * (int64_t)r), W, L, beam);
    for (int64_t t = 0; t < row_len[r]; ++t) {
      const int64_t rt = (int64_t)r * T + t;
      advance(beam, next, entries, lp + rt * V, lp_blank[rt], cands + rt * K, lp_cands + rt * K, K,
              (int32_t)(first_frame[r] + t), W);
      beam.swap(next);
    }
    int64_t longest = 0;
    for (const Prefix& p : beam) longest = (int64_t)p.tokens.size() > longest ? (int64_t)p.tokens.size() : longest;
    if (longest > L) return 1;
    longest_out[r] = longest;
  }
  for (int r = 0; r < R; ++r) write_row(row_ptrs(ptrs + 8 * (int64_t)r), W, L, rows[r], old_window[r]);
  return 0;
}

}  // extern "C"
