// The fast word search's native path: the rule of oasr/ctc/words.py (reference: oasr/reference/word_search.py,
// WordSearch._frame / _bound / _commit / finalize) in C++, one call per cohort.
//
// The model (oasr_word_model_new) is the WordLM as flat arrays: a lexicon trie (node 0 = the empty prefix;
// children in CSR form sorted by letter; per node its lookahead and its word id or -1), the bigram tables of
// WordLM.tables(), and per token id its kind (-1: no candidate, -2: the space, else the letter index). Each
// stream's state (oasr_word_state_new) owns its beam, its committed words and an arena of word nodes: a
// hypothesis's uncommitted words are a linked list from its newest word back to the oldest (nodes shared
// between hypotheses), so extending by a word is one node, and a key comparison walks two lists only until
// they meet. After each chunk (and when the bound on uncommitted words applies, after a frame) the common
// first words move to the committed list and the arena is rebuilt from the live hypotheses (garbage
// collected), so its size is bounded by beam * max_words, not by the stream.
//
// Bit-equality with the reference: every score is computed with the same double operations in the same
// order (lae = a + log1p(exp(b - a)) with a >= b; glibc exp/log1p, as Python's math module calls), built
// with -O2 -ffp-contract=off (no FMA contraction, no fast math); candidates, merge order (generation order:
// beam order, stay first, then extensions by ascending token id), the stable ranking and the commit rule
// are the reference's, step for step. Plain C ABI for ctypes (oasr/fast/word_search.py builds and loads it).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

const double NEG = -1e30;

inline double lae(double a, double b) {
  if (a < b) std::swap(a, b);
  if (b <= NEG) return a;
  return a + std::log1p(std::exp(b - a));
}

inline uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 29;
  return h;
}

const uint64_t EMPTY_WORDS_HASH = 0x243f6a8885a308d3ULL;

struct Model {
  int64_t n_words;  // W: ids 0..W-1 words, W = </s>, W + 1 = <s>
  std::vector<int64_t> child_start;  // [nodes + 1]
  std::vector<int32_t> child_letter, child_node;
  std::vector<double> lookahead;  // [nodes]
  std::vector<int64_t> node_word;  // [nodes]: word id or -1
  std::vector<double> unigram, backoff;  // [W + 1], [W + 2]
  std::vector<uint8_t> has_backoff;  // [W + 2]
  std::vector<int64_t> pair_keys;  // sorted
  std::vector<double> pair_logp;
  std::vector<int32_t> token_kind;  // [V]

  int32_t child(int32_t node, int32_t letter) const {
    for (int64_t i = child_start[node]; i < child_start[node + 1]; ++i)
      if (child_letter[i] == letter) return child_node[i];
    return -1;
  }

  // WordLM.logp: the bigram if seen, else backoff + unigram if the context was seen, else the unigram.
  double logp(int64_t context, int64_t word) const {
    const int64_t key = context * (n_words + 2) + word;
    auto it = std::lower_bound(pair_keys.begin(), pair_keys.end(), key);
    if (it != pair_keys.end() && *it == key) return pair_logp[it - pair_keys.begin()];
    if (has_backoff[context]) return backoff[context] + unigram[word];
    return unigram[word];
  }
};

struct WordNode {
  int64_t word, first, last;
  int32_t parent;  // the previous (older) word, -1 at the first uncommitted word
  int32_t depth;  // words in the list ending here
  uint64_t hash;  // of the word ids of the list
};

struct Hyp {
  int32_t words;  // newest uncommitted word node, -1 for none
  int32_t partial;  // trie node
  int64_t pstart, pend;
  double pb, pnb, lm;
  int64_t n, last_word, last_token;  // last_token -1: None
};

struct Committed {
  int64_t word, first, last;
};

struct State {
  int64_t frame = 0;
  std::vector<Committed> committed;
  std::vector<Hyp> beams;
  std::vector<WordNode> arena;
};

struct Config {
  int64_t beam_size, token_topk;
  double prune_log, lm_weight, word_bonus;
};

inline uint64_t words_hash(const State& s, int32_t node) { return node < 0 ? EMPTY_WORDS_HASH : s.arena[node].hash; }
inline int32_t words_depth(const State& s, int32_t node) { return node < 0 ? 0 : s.arena[node].depth; }

// Same word ids (frames aside), for two lists of equal depth.
bool same_words(const State& s, int32_t a, int32_t b) {
  while (a != b) {
    if (a < 0 || b < 0 || s.arena[a].word != s.arena[b].word) return false;
    a = s.arena[a].parent;
    b = s.arena[b].parent;
  }
  return true;
}

struct Entry {
  Hyp h;
  uint64_t key;
  double score;
};

// One frame's entries, with an open-addressing table from key to entry.
struct Frame {
  std::vector<Entry> entries;
  std::vector<int32_t> table;
  std::vector<int32_t> cands;
  std::vector<int32_t> ranked;
  uint64_t mask = 0;

  void reset(size_t most) {
    entries.clear();
    size_t cap = 16;
    while (cap < 2 * most) cap <<= 1;
    if (table.size() != cap) table.assign(cap, -1);
    else std::fill(table.begin(), table.end(), -1);
    mask = cap - 1;
  }
};

// The entry of (words, partial), or a new one copied from proto; `extra` >= 0: the key's words are `words`
// followed by word `extra` (a space extension; the node is made only when the entry is new).
int32_t find_or_add(State& s, Frame& f, int32_t words, int64_t extra, int32_t partial, const Hyp& proto,
                    int64_t first, int64_t last) {
  const uint64_t wh = extra < 0 ? words_hash(s, words) : mix(words_hash(s, words), (uint64_t)extra);
  const int32_t depth = words_depth(s, words) + (extra < 0 ? 0 : 1);
  const uint64_t key = mix(wh, (uint64_t)partial);
  uint64_t slot = key & f.mask;
  while (f.table[slot] >= 0) {
    const Entry& e = f.entries[f.table[slot]];
    if (e.key == key && e.h.partial == partial && words_depth(s, e.h.words) == depth) {
      bool same;
      if (extra < 0) {
        same = same_words(s, e.h.words, words);
      } else {
        const WordNode& x = s.arena[e.h.words];
        same = x.word == extra && same_words(s, x.parent, words);
      }
      if (same) return f.table[slot];
    }
    slot = (slot + 1) & f.mask;
  }
  Entry e;
  e.h = proto;
  if (extra >= 0) {
    s.arena.push_back(WordNode{extra, first, last, words, depth, wh});
    e.h.words = (int32_t)s.arena.size() - 1;
  }
  e.key = key;
  e.score = 0.0;
  f.entries.push_back(e);
  f.table[slot] = (int32_t)f.entries.size() - 1;
  return f.table[slot];
}

// WordSearch._candidates: char tokens above prune_log, the token_topk largest (ties: lower id), ascending.
void candidates(const Model& m, const Config& c, const double* row, int64_t V, std::vector<int32_t>& out) {
  out.clear();
  for (int64_t t = 1; t < V; ++t)
    if (m.token_kind[t] != -1 && row[t] > c.prune_log) out.push_back((int32_t)t);
  auto better = [row](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); };
  if ((int64_t)out.size() > c.token_topk) {
    std::partial_sort(out.begin(), out.begin() + c.token_topk, out.end(), better);
    out.resize(c.token_topk);
  }
  std::sort(out.begin(), out.end());
}

// WordSearch._frame: one frame of one stream.
void advance(const Model& m, const Config& c, State& s, Frame& f, const double* row, int64_t V) {
  const int64_t t = s.frame;
  candidates(m, c, row, V, f.cands);
  f.reset(s.beams.size() * (1 + f.cands.size()));
  for (size_t i = 0; i < s.beams.size(); ++i) {
    const Hyp h = s.beams[i];
    const double total = lae(h.pb, h.pnb);
    Hyp proto = h;
    proto.pb = NEG;
    proto.pnb = NEG;
    int32_t e = find_or_add(s, f, h.words, -1, h.partial, proto, 0, 0);
    f.entries[e].h.pb = lae(f.entries[e].h.pb, total + row[0]);
    if (h.last_token >= 0) f.entries[e].h.pnb = lae(f.entries[e].h.pnb, h.pnb + row[h.last_token]);
    for (int32_t tok : f.cands) {
      const double source = tok == h.last_token ? h.pb : total;
      if (source <= NEG) continue;
      const int32_t kind = m.token_kind[tok];
      if (kind == -2) {  // the space: the partial must be a word
        if (h.partial == 0 || m.node_word[h.partial] < 0) continue;
        const int64_t wid = m.node_word[h.partial];
        Hyp p = h;
        p.partial = 0;
        p.pstart = 0;
        p.pend = 0;
        p.pb = NEG;
        p.pnb = NEG;
        p.lm = h.lm + m.logp(h.last_word, wid);
        p.n = h.n + 1;
        p.last_word = wid;
        p.last_token = tok;
        e = find_or_add(s, f, h.words, wid, 0, p, h.pstart, h.pend);
      } else {  // a letter: partial + letter must be a lexicon prefix
        const int32_t spelled = m.child(h.partial, kind);
        if (spelled < 0) continue;
        Hyp p = h;
        p.partial = spelled;
        p.pstart = h.partial == 0 ? t : h.pstart;
        p.pend = t;
        p.pb = NEG;
        p.pnb = NEG;
        p.last_token = tok;
        e = find_or_add(s, f, h.words, -1, spelled, p, 0, 0);
      }
      f.entries[e].h.pnb = lae(f.entries[e].h.pnb, source + row[tok]);
    }
  }
  // the beam_size best by score, ties in generation order (an insertion into a sorted list: stable)
  const size_t cap = (size_t)std::min<int64_t>(c.beam_size, (int64_t)f.entries.size());
  f.ranked.clear();
  for (size_t e = 0; e < f.entries.size(); ++e) {
    Entry& x = f.entries[e];
    x.score = lae(x.h.pb, x.h.pnb) + c.lm_weight * (x.h.lm + m.lookahead[x.h.partial]) +
              c.word_bonus * (double)x.h.n;
    if (f.ranked.size() == cap && !(x.score > f.entries[f.ranked.back()].score)) continue;
    size_t pos = f.ranked.size();
    if (pos < cap) f.ranked.push_back((int32_t)e);
    else pos = cap - 1;
    while (pos > 0 && x.score > f.entries[f.ranked[pos - 1]].score) {
      f.ranked[pos] = f.ranked[pos - 1];
      --pos;
    }
    f.ranked[pos] = (int32_t)e;
  }
  s.beams.resize(f.ranked.size());
  for (size_t r = 0; r < f.ranked.size(); ++r) s.beams[r] = f.entries[f.ranked[r]].h;
  s.frame = t + 1;
}

// A hypothesis's uncommitted word nodes, oldest first.
void word_list(const State& s, int32_t node, std::vector<int32_t>& out) {
  out.clear();
  for (; node >= 0; node = s.arena[node].parent) out.push_back(node);
  std::reverse(out.begin(), out.end());
}

inline bool same_record(const WordNode& a, const WordNode& b) {
  return a.word == b.word && a.first == b.first && a.last == b.last;
}

// WordSearch._commit, then the arena rebuilt from the live hypotheses (less the committed words).
void commit_and_collect(State& s) {
  std::vector<std::vector<int32_t>> lists(s.beams.size());
  for (size_t i = 0; i < s.beams.size(); ++i) word_list(s, s.beams[i].words, lists[i]);
  const std::vector<int32_t>& first = lists[0];
  size_t k = first.size();
  for (size_t i = 1; i < lists.size() && k; ++i) {
    const std::vector<int32_t>& words = lists[i];
    k = std::min(k, words.size());
    size_t same = 0;
    while (same < k && (words[same] == first[same] || same_record(s.arena[words[same]], s.arena[first[same]])))
      ++same;
    k = same;
  }
  for (size_t j = 0; j < k; ++j) {
    const WordNode& w = s.arena[first[j]];
    s.committed.push_back(Committed{w.word, w.first, w.last});
  }
  std::vector<WordNode> arena;
  std::vector<int32_t> moved(s.arena.size(), -1);
  for (size_t i = 0; i < s.beams.size(); ++i) {
    int32_t parent = -1;
    for (size_t j = k; j < lists[i].size(); ++j) {
      const int32_t old = lists[i][j];
      if (moved[old] < 0) {
        const WordNode& w = s.arena[old];
        const uint64_t parent_hash = parent < 0 ? EMPTY_WORDS_HASH : arena[parent].hash;
        const int32_t depth = parent < 0 ? 1 : arena[parent].depth + 1;
        arena.push_back(WordNode{w.word, w.first, w.last, parent, depth, mix(parent_hash, (uint64_t)w.word)});
        moved[old] = (int32_t)arena.size() - 1;
      }
      parent = moved[old];
    }
    s.beams[i].words = parent;
  }
  s.arena.swap(arena);
}

inline int32_t deepest(const State& s) {
  int32_t most = 0;
  for (const Hyp& h : s.beams) most = std::max(most, words_depth(s, h.words));
  return most;
}

// The bound on uncommitted words after a frame (oasr/ctc/words.py; WordSearch._bound): O(beam) unless some
// hypothesis holds more than max_words words, then commits (which also collects the arena) and drops.
void bound(State& s, int64_t max_words) {
  if (deepest(s) <= max_words) return;
  commit_and_collect(s);  // depths are counted past the shared words (committing them changes nothing)
  if (deepest(s) <= max_words) return;
  const int64_t k = (int64_t)words_depth(s, s.beams[0].words) - max_words / 2;
  if (k > 0) {  // 1. alternatives that parted from the best more than max_words / 2 of its words ago
    std::vector<int32_t> first, list;
    word_list(s, s.beams[0].words, first);
    size_t kept = 0;
    for (size_t i = 0; i < s.beams.size(); ++i) {
      word_list(s, s.beams[i].words, list);
      bool same = (int64_t)list.size() >= k;
      for (int64_t j = 0; same && j < k; ++j)
        same = list[j] == first[j] || same_record(s.arena[list[j]], s.arena[first[j]]);
      if (same) s.beams[kept++] = s.beams[i];
    }
    s.beams.resize(kept);
    commit_and_collect(s);
  }
  size_t kept = 0;  // 2. hypotheses still deeper than max_words (never the best)
  for (size_t i = 0; i < s.beams.size(); ++i)
    if (words_depth(s, s.beams[i].words) <= max_words) s.beams[kept++] = s.beams[i];
  s.beams.resize(kept);
  commit_and_collect(s);
}

// Drop unreachable nodes without committing (a long chunk's garbage).
void collect(State& s) {
  std::vector<WordNode> arena;
  std::vector<int32_t> moved(s.arena.size(), -1);
  std::vector<int32_t> list;
  for (Hyp& h : s.beams) {
    word_list(s, h.words, list);
    int32_t parent = -1;
    for (int32_t old : list) {
      if (moved[old] < 0) {
        WordNode w = s.arena[old];
        w.parent = parent;
        arena.push_back(w);
        moved[old] = (int32_t)arena.size() - 1;
      }
      parent = moved[old];
    }
    h.words = parent;
  }
  s.arena.swap(arena);
}

const int64_t COLLECT_EVERY = 64;  // frames of a long chunk between collections (at most beam nodes a frame)

}  // namespace

extern "C" {

// The model. Trie: n_nodes nodes, child_start [n_nodes + 1], child_letter / child_node [n_nodes - 1],
// lookahead [n_nodes], node_word [n_nodes]; the LM: n_words W, unigram [W + 1], backoff / has_backoff
// [W + 2], n_pairs pair_keys / pair_logp; token_kind [V]. Everything is copied.
void* oasr_word_model_new(int64_t n_nodes, const int64_t* child_start, const int32_t* child_letter,
                          const int32_t* child_node, const double* lookahead, const int64_t* node_word,
                          int64_t n_words, const double* unigram, const double* backoff, const uint8_t* has_backoff,
                          int64_t n_pairs, const int64_t* pair_keys, const double* pair_logp, int64_t V,
                          const int32_t* token_kind) {
  Model* m = new Model();
  m->n_words = n_words;
  m->child_start.assign(child_start, child_start + n_nodes + 1);
  m->child_letter.assign(child_letter, child_letter + child_start[n_nodes]);
  m->child_node.assign(child_node, child_node + child_start[n_nodes]);
  m->lookahead.assign(lookahead, lookahead + n_nodes);
  m->node_word.assign(node_word, node_word + n_nodes);
  m->unigram.assign(unigram, unigram + n_words + 1);
  m->backoff.assign(backoff, backoff + n_words + 2);
  m->has_backoff.assign(has_backoff, has_backoff + n_words + 2);
  m->pair_keys.assign(pair_keys, pair_keys + n_pairs);
  m->pair_logp.assign(pair_logp, pair_logp + n_pairs);
  m->token_kind.assign(token_kind, token_kind + V);
  return m;
}

void oasr_word_model_free(void* model) { delete static_cast<Model*>(model); }

// A fresh stream: one empty hypothesis (pb 0, pnb NEG, last word <s>, no token).
void* oasr_word_state_new(int64_t start_id) {
  State* s = new State();
  s->beams.push_back(Hyp{-1, 0, 0, 0, 0.0, NEG, 0.0, 0, start_id, -1});
  return s;
}

void oasr_word_state_free(void* state) { delete static_cast<State*>(state); }

void* oasr_word_state_clone(const void* state) { return new State(*static_cast<const State*>(state)); }

// Advance R states (in order; one state may appear twice) over their chunks: rows offsets[r] .. offsets[r + 1]
// of lp [*, V]; after each frame the bound, after each state's chunk the commit.
void oasr_word_decode(const void* model, int64_t beam_size, int64_t token_topk, double prune_log, double lm_weight,
                      double word_bonus, int64_t max_words, int64_t R, const int64_t* states, const double* lp,
                      const int64_t* offsets, int64_t V) {
  const Model& m = *static_cast<const Model*>(model);
  const Config c{beam_size, token_topk, prune_log, lm_weight, word_bonus};
  Frame f;
  for (int64_t r = 0; r < R; ++r) {
    State& s = *reinterpret_cast<State*>(states[r]);
    for (int64_t row = offsets[r]; row < offsets[r + 1]; ++row) {
      advance(m, c, s, f, lp + row * V, V);
      bound(s, max_words);
      if ((row - offsets[r]) % COLLECT_EVERY == COLLECT_EVERY - 1) collect(s);
    }
    commit_and_collect(s);
  }
}

// out: frame, committed words, hypotheses, words of hypotheses lo .. hi - 1.
void oasr_word_sizes(const void* state, int64_t lo, int64_t hi, int64_t* out) {
  const State& s = *static_cast<const State*>(state);
  out[0] = s.frame;
  out[1] = (int64_t)s.committed.size();
  out[2] = (int64_t)s.beams.size();
  int64_t words = 0;
  for (int64_t i = lo; i < hi; ++i) words += words_depth(s, s.beams[i].words);
  out[3] = words;
}

// Committed words from `since` (3 each: word, first, last); hypotheses lo .. hi - 1: ints (7 each: words,
// partial node, pstart, pend, n, last word, last token or -1), floats (3 each: pb, pnb, lm), their words
// concatenated oldest first (3 each).
void oasr_word_export(const void* state, int64_t since, int64_t lo, int64_t hi, int64_t* committed, int64_t* ints,
                      double* floats, int64_t* words) {
  const State& s = *static_cast<const State*>(state);
  for (size_t i = (size_t)since; i < s.committed.size(); ++i, committed += 3) {
    committed[0] = s.committed[i].word;
    committed[1] = s.committed[i].first;
    committed[2] = s.committed[i].last;
  }
  std::vector<int32_t> list;
  for (int64_t i = lo; i < hi; ++i, ints += 7, floats += 3) {
    const Hyp& h = s.beams[i];
    word_list(s, h.words, list);
    const int64_t v[7] = {(int64_t)list.size(), h.partial, h.pstart, h.pend, h.n, h.last_word, h.last_token};
    std::memcpy(ints, v, sizeof v);
    floats[0] = h.pb;
    floats[1] = h.pnb;
    floats[2] = h.lm;
    for (int32_t node : list) {
      const WordNode& w = s.arena[node];
      words[0] = w.word;
      words[1] = w.first;
      words[2] = w.last;
      words += 3;
    }
  }
}

// Replace a state's contents (the layout of oasr_word_export; ids checked by the caller).
void oasr_word_import(void* state, int64_t frame, int64_t n_committed, const int64_t* committed, int64_t n_beams,
                      const int64_t* ints, const double* floats, const int64_t* words) {
  State& s = *static_cast<State*>(state);
  s.frame = frame;
  s.committed.clear();
  for (int64_t i = 0; i < n_committed; ++i, committed += 3)
    s.committed.push_back(Committed{committed[0], committed[1], committed[2]});
  s.beams.clear();
  s.arena.clear();
  for (int64_t i = 0; i < n_beams; ++i, ints += 7, floats += 3) {
    int32_t node = -1;
    for (int64_t j = 0; j < ints[0]; ++j, words += 3) {
      const uint64_t parent_hash = node < 0 ? EMPTY_WORDS_HASH : s.arena[node].hash;
      s.arena.push_back(WordNode{words[0], words[1], words[2], node, words_depth(s, node) + 1,
                                 mix(parent_hash, (uint64_t)words[0])});
      node = (int32_t)s.arena.size() - 1;
    }
    s.beams.push_back(Hyp{node, (int32_t)ints[1], ints[2], ints[3], floats[0], floats[1], floats[2], ints[4],
                          ints[5], ints[6]});
  }
}

// WordSearch.finalize's choice: the index of the hypothesis with the best final score (ties: beam order), or -1
// when every hypothesis is in the middle of a non-word (none can finish).
int64_t oasr_word_finalize(const void* model, double lm_weight, double word_bonus, const void* state) {
  const Model& m = *static_cast<const Model*>(model);
  const State& s = *static_cast<const State*>(state);
  int64_t best = -1;
  double best_score = 0.0;
  for (size_t i = 0; i < s.beams.size(); ++i) {
    const Hyp& h = s.beams[i];
    double lms = h.lm;
    int64_t n = h.n, last_word = h.last_word;
    if (h.partial != 0 && m.node_word[h.partial] < 0) continue;  // in the middle of a non-word: cannot finish
    if (h.partial != 0) {
      const int64_t wid = m.node_word[h.partial];
      lms = lms + m.logp(last_word, wid);
      n = n + 1;
      last_word = wid;
    }
    lms = lms + m.logp(last_word, m.n_words);
    const double score = lae(h.pb, h.pnb) + lm_weight * lms + word_bonus * (double)n;
    if (best < 0 || score > best_score) {
      best = (int64_t)i;
      best_score = score;
    }
  }
  return best;
}

}  // extern "C"
