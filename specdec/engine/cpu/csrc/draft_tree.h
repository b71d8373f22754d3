// The whole EAGLE draft of a step in one call (EAGLE-1 or EAGLE-3 head): the catch-up of the committed pairs, then
// every depth's head layer, draft LM head, log-softmax and top-k, the cumulative-score frontier and the final budget
// re-rank. Included at the end of kernels.cpp (it reuses that file's products, layer and attention);
// specdec/heads/draft_call.py states the contract and holds the torch reference this must equal.
//
// Per sequence b (B of them, k = topk children per node):
//   catch-up: its qlen[b] rows (the committed pairs since the last step: the embedding of the row's token, the
//             target's feature of the token before) are appended to its slot at cache index start[b] + i, position
//             pos[row], causal among themselves, as sd_eagle3_step / sd_eagle1_step feed them (the same products in
//             the same order: the same keys and values); the head's output at the last row (the pending pair) is
//             last[b] and its draft logits root_logits[b]; the slot then holds start[b] + qlen[b] pairs.
//   depth 1:  the top k of log_softmax(root_logits[b]);
//   depth d:  the k frontier nodes of depth d-1 are appended to the head's slot as new pairs (embedding of the node's
//             token, the head's output at its parent: last[b] for depth 1) at position pos0 + d - 1 (pos0 = the
//             pending pair's), cache index start[b] + qlen[b] + (d - 2) k + i, each seeing the cached prefix and its
//             ancestors among the appended nodes (itself included); their k x k children are scored
//             parent score + log-prob and the best k (ties: the earlier-made) become the next frontier.
//   then:     the budget best of all candidates by a stable descending sort (ties: earlier-made first), kept in
//             creation order, parents remapped to kept positions (-1 = child of the pending token).
// Unlike a re-feed of every frontier node so far per depth, each node is fed once: (depth - 1) k rows in all.
// The drafted nodes' keys past start[b] + qlen[b] are scratch that the next append overwrites (kt_valid[slot] ends
// at start[b] + qlen[b]; the caller sets the slot's length to it). Deterministic; not batch-invariant (a draft needs
// not be).

#include <algorithm>
#include <memory>

struct SdDraftHead {       // an EAGLE head as the tree call reads it
  int32_t kind;            // 1: EAGLE-1: x = fc(cat(emb, feat)) (+ bias), the layer on x, logits = lm(x)
                           // 3: EAGLE-3: x = feat, a = cat(rmsnorm(emb, w_in), rmsnorm(x, w_hid)), the layer on a,
                           //    logits = lm(rmsnorm(x, w_out))
  const SdWeight* fc;      // EAGLE-1: [D, 2D] over cat(emb, feat), every row; EAGLE-3: [D, F] over the target's fused
                           // features (catch-up rows whose features are F != D wide), or NULL
  const float* w_in;       // EAGLE-3 [D]; else NULL
  const float* w_hid;      // EAGLE-3 [D]; else NULL
  const float* w_out;      // EAGLE-3 [D]; else NULL
  const SdWeight* lm;      // [Vd, D] the draft LM head (rows of the draft vocabulary)
  const SdWeight* emb;     // [Vd, D] the target's input embedding of each draft id (packed or plain)
  const float* cos;        // [npos, hd] RoPE by position
  const float* sin;        // [npos, hd] signed sin
  int64_t npos;
};

// out [K] fp32 = row n of w [N, K] (packed or plain, fp32/bf16/f16)
static void weight_row(const SdWeight* w, int64_t n, float* out) {
  const int64_t K = w->K;
  const bool dp = w->dtype == 1 && kDp;
  for (int64_t k = 0; k < K; k++) {
    const int64_t at = w->packed ? packed_at(dp, n, k, K) : n * K + k;
    if (w->dtype == 0) out[k] = ((const float*)w->data)[at];
    else if (w->dtype == 1) out[k] = bf16_to_f32(((const u16*)w->data)[at]);
    else out[k] = f16_to_f32(((const u16*)w->data)[at]);
  }
}

// some lane of v > the same lane of t (ordered: a NaN lane is never greater)
static inline bool any_gt(vf v, vf t) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(v, t, _CMP_GT_OQ) != 0;
#elif defined(__AVX2__)
  return _mm256_movemask_ps(_mm256_cmp_ps(v, t, _CMP_GT_OQ)) != 0;
#else
  for (int i = 0; i < VL; i++)
    if (v.l[i] > t.l[i]) return true;
  return false;
#endif
}

// log_softmax of x [V] at its k largest values (ties: the lower index first; NaN never chosen) -> ids, lps (desc).
// The max and the scan are vectorised (the scalar max was one dependent maxss per value, ~4 cycles each: ~40 us a
// row of a 32k draft vocabulary): the max is the same in any order (a NaN never wins, as in x > m ? x : m), and the
// scan visits each value in the scalar order except blocks of VL in which none passes the k-th best so far, which
// the scalar scan would skip one by one; so the ids and lps are the scalar version's, bit for bit.
static void topk_logsoftmax(const float* x, int64_t V, int64_t k, int64_t* ids, float* lps) {
  const int64_t nv = V - V % VL;
  vf mv = vset1(-INFINITY);
  for (int64_t j = 0; j < nv; j += VL) mv = vmax(vload(x + j), mv);
  float mx = -INFINITY, lane[VL];
  vstore(lane, mv);
  for (int i = 0; i < VL; i++) mx = lane[i] > mx ? lane[i] : mx;
  for (int64_t j = nv; j < V; j++) mx = x[j] > mx ? x[j] : mx;
  const vf neg = vset1(-mx);
  vf acc = vzero();
  for (int64_t j = 0; j < nv; j += VL) acc = vadd(acc, vexp(vadd(vload(x + j), neg)));
  float s = vsum(acc);
  for (int64_t j = nv; j < V; j++) s += exp_poly(x[j] - mx);
  const float ls = std::log(s);
  int64_t n = 0;
  auto visit = [&](int64_t j) {
    const float v = x[j];
    if (n == k && !(v > lps[k - 1])) return;
    int64_t i = n < k ? n++ : k - 1;
    while (i > 0 && v > lps[i - 1]) {  // strictly: an equal value made earlier stays before
      lps[i] = lps[i - 1];
      ids[i] = ids[i - 1];
      i--;
    }
    lps[i] = v;
    ids[i] = j;
  };
  int64_t j = 0;
  for (; j < V && n < k; j++) visit(j);
  for (; j < V && j % VL; j++) visit(j);  // up to a block boundary
  for (; j + VL <= V; j += VL)
    if (any_gt(vload(x + j), vset1(lps[k - 1])))
      for (int64_t u = j; u < j + VL; u++) visit(u);
  for (; j < V; j++) visit(j);
  for (int64_t i = 0; i < n; i++) lps[i] = (lps[i] - mx) - ls;
  for (int64_t i = n; i < k; i++) {  // fewer than k comparable values (NaN logits): -inf children, id 0
    lps[i] = -INFINITY;
    ids[i] = 0;
  }
}

// indices of the k best of sc[0, n) (desc, ties: lower index first), written ascending into out
static void best_k_sorted(const float* sc, int64_t n, int64_t k, int64_t* out) {
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; i++) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sc[a] > sc[b]; });
  std::sort(order.begin(), order.begin() + k);
  for (int64_t i = 0; i < k; i++) out[i] = order[i];
}

extern "C" {

// Returns the nodes per row N = min(budget, k + (depth - 1) k^2), or -1 when a kept node's parent was pruned
// (NaN draft logits). Catch-up rows (R = the sum of qlen, sequence after sequence): emb [R, D], feat [R, F], pos [R].
// Outputs: last [B, D], root_logits [B, Vd] (the catch-up's at each pending pair); [B, N]: tok (draft ids), par (kept
// position of the parent, -1 = the pending token), score (cumulative draft log-prob), rank (0 = best score; ties:
// the earlier-made first). start [B]: each slot's length before the call. s: scratch for max(R, B k) rows, its xb
// wide enough for the fc's input (EAGLE-1: 2D; EAGLE-3: F).
int64_t sd_eagle_tree(const SdModel* m, const SdLayer* layer, const SdDraftHead* h, int64_t B, const int64_t* slot,
                      const int64_t* start, const int64_t* qlen, const float* emb_cu, const float* feat_cu, int64_t Fw,
                      const int64_t* pos_cu, int64_t depth, int64_t topk, int64_t budget, int64_t* kt_valid,
                      const SdScratch* s, float* last, float* root_logits, int64_t* tok, int64_t* par, float* score,
                      int64_t* rank) {
  const int64_t D = m->D, hd = m->hd, Vd = h->lm->N;
  const int64_t k = imin(topk, Vd), C = k + (depth - 1) * k * k, N = imin(budget, C);
  const int64_t T = B * k, Fmax = (depth - 1) * k;
  // the catch-up's rows: sequence b's are [e0[b], e0[b] + qlen[b]), its pending pair the last of them
  std::vector<int64_t> e0(B + 1, 0);
  for (int64_t b = 0; b < B; b++) e0[b + 1] = e0[b] + qlen[b];
  const int64_t R = e0[B];
  std::vector<int64_t> c_slot(R), c_start(R), c_index(R), c_nnew(R);
  std::vector<float> c_cs(R * hd), c_sn(R * hd), c_x(R * D), c_a(R * 2 * D);
  std::vector<int64_t> tstart(B), pos0(B);  // the tree's: each slot's length after the catch-up, the pending position
  for (int64_t b = 0; b < B; b++) {
    for (int64_t i = 0; i < qlen[b]; i++) {
      const int64_t t = e0[b] + i;
      c_slot[t] = slot[b];
      c_start[t] = start[b];
      c_index[t] = i;
      c_nnew[t] = qlen[b];
      std::memcpy(c_cs.data() + t * hd, h->cos + pos_cu[t] * hd, hd * sizeof(float));
      std::memcpy(c_sn.data() + t * hd, h->sin + pos_cu[t] * hd, hd * sizeof(float));
    }
    tstart[b] = start[b] + qlen[b];
    pos0[b] = pos_cu[e0[b + 1] - 1];
    kt_valid[slot[b]] = imin(kt_valid[slot[b]], start[b]);  // cut back since the last call (rollback)
  }
  const SdRows rc{R, c_slot.data(), c_start.data(), c_index.data(), c_nnew.data(), nullptr, 0, c_cs.data(),
                  c_sn.data(), kt_valid};
  // candidates per row, in creation order: draft id, parent candidate (-1 = pending), cumulative score
  std::vector<int64_t> ctok(B * C), cpar(B * C);
  std::vector<float> csc(B * C);
  std::vector<int64_t> front(B * k);                 // candidate ids of each row's frontier (ascending)
  std::vector<int64_t> fed_of(B * C, -1);            // candidate -> its index among the row's fed nodes
  std::vector<uint8_t> anc(B * Fmax * Fmax, 0);      // [B, F, F] fed node i sees fed node j (ancestor or self)
  std::vector<float> outs((size_t)B * (Fmax ? Fmax : 1) * D);  // head output at each fed node
  std::vector<float> x(T * D), a(T * 2 * D), emb(T * D), cs(T * hd), sn(T * hd);
  std::unique_ptr<float[]> logits(new float[T * Vd]);  // every value written by the LM head: not zeroed (~0.4 MB)
  std::vector<uint8_t> mask(T * (Fmax ? Fmax : 1));
  std::vector<int64_t> r_slot(T), r_start(T), r_index(T), r_nnew(T);
  std::vector<int64_t> ids(T * k);
  std::vector<float> lps(T * k);
  int64_t made = k;  // candidates so far (the same in every row)
#pragma omp parallel
  {
    // the catch-up: sd_eagle3_step's / sd_eagle1_step's work on the R rows, logits at each sequence's last row
    if (h->kind == 3) {
      float* xc = c_x.data();
      if (Fw != D) linear_any(h->fc, feat_cu, R, xc, 0, s->xb);
      else {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < R; t++) std::memcpy(xc + t * D, feat_cu + t * D, D * sizeof(float));
      }
#pragma omp for schedule(static)
      for (int64_t t = 0; t < R; t++) {
        rmsnorm_row(emb_cu + t * D, h->w_in, c_a.data() + t * 2 * D, D, m->eps);
        rmsnorm_row(xc + t * D, h->w_hid, c_a.data() + t * 2 * D + D, D, m->eps);
      }
      layer_from_ws(m, layer, &rc, xc, c_a.data(), s);
#pragma omp for schedule(static)
      for (int64_t b = 0; b < B; b++) rmsnorm_row(xc + (e0[b + 1] - 1) * D, h->w_out, s->h + b * D, D, m->eps);
    } else {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < R; t++) {
        std::memcpy(c_a.data() + t * 2 * D, emb_cu + t * D, D * sizeof(float));
        std::memcpy(c_a.data() + t * 2 * D + D, feat_cu + t * D, D * sizeof(float));
      }
      linear_any(h->fc, c_a.data(), R, c_x.data(), 0, s->xb);
      layer_from_ws(m, layer, &rc, c_x.data(), c_x.data(), s);
#pragma omp for schedule(static)
      for (int64_t b = 0; b < B; b++) std::memcpy(s->h + b * D, c_x.data() + (e0[b + 1] - 1) * D, D * sizeof(float));
    }
    linear_any(h->lm, s->h, B, root_logits, 0, s->xb);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; b++) {  // depth 1
      std::memcpy(last + b * D, c_x.data() + (e0[b + 1] - 1) * D, D * sizeof(float));
      topk_logsoftmax(root_logits + b * Vd, Vd, k, ctok.data() + b * C, csc.data() + b * C);
      for (int64_t i = 0; i < k; i++) {
        cpar[b * C + i] = -1;
        front[b * k + i] = i;
      }
      kt_valid[slot[b]] = tstart[b];  // the catch-up's attention blocked every key it read
    }
    for (int64_t d = 2; d <= depth; d++) {
      const int64_t F0 = (d - 2) * k, F = F0 + k;  // nodes fed before this depth, and after it
#pragma omp single
      {
        for (int64_t b = 0; b < B; b++)
          for (int64_t i = 0; i < k; i++) {
            const int64_t t = b * k + i, c = front[b * k + i], p = cpar[b * C + c], fi = F0 + i;
            fed_of[b * C + c] = fi;
            uint8_t* an = anc.data() + (b * Fmax + fi) * Fmax;
            if (p >= 0) std::memcpy(an, anc.data() + (b * Fmax + fed_of[b * C + p]) * Fmax, Fmax);
            an[fi] = 1;
            std::memcpy(mask.data() + t * F, an, F);
            r_slot[t] = slot[b];
            r_start[t] = tstart[b];
            r_index[t] = fi;
            r_nnew[t] = F;
            const int64_t pos = pos0[b] + d - 1;
            std::memcpy(cs.data() + t * hd, h->cos + pos * hd, hd * sizeof(float));
            std::memcpy(sn.data() + t * hd, h->sin + pos * hd, hd * sizeof(float));
          }
      }
      SdRows r{T, r_slot.data(), r_start.data(), r_index.data(), r_nnew.data(), mask.data(), F, cs.data(), sn.data(),
               kt_valid};
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; t++) {  // the pair of each frontier node: (its parent's output, its token)
        const int64_t b = t / k, c = front[t], p = cpar[b * C + c];
        const float* feat = p < 0 ? last + b * D : outs.data() + (b * Fmax + fed_of[b * C + p]) * D;
        weight_row(h->emb, ctok[b * C + c], emb.data() + t * D);
        if (h->kind == 3) {
          std::memcpy(x.data() + t * D, feat, D * sizeof(float));
          rmsnorm_row(emb.data() + t * D, h->w_in, a.data() + t * 2 * D, D, m->eps);
          rmsnorm_row(feat, h->w_hid, a.data() + t * 2 * D + D, D, m->eps);
        } else {
          std::memcpy(a.data() + t * 2 * D, emb.data() + t * D, D * sizeof(float));
          std::memcpy(a.data() + t * 2 * D + D, feat, D * sizeof(float));
        }
      }
      if (h->kind == 3) {
        layer_from_ws(m, layer, &r, x.data(), a.data(), s);
        rmsnorm_ws(x.data(), h->w_out, s->h, T, D, m->eps);
        linear_any(h->lm, s->h, T, logits.get(), 0, s->xb);
      } else {
        linear_any(h->fc, a.data(), T, x.data(), 0, s->xb);
        layer_from_ws(m, layer, &r, x.data(), x.data(), s);
        linear_any(h->lm, x.data(), T, logits.get(), 0, s->xb);
      }
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; t++) {
        const int64_t b = t / k, fi = F0 + t % k;
        std::memcpy(outs.data() + (b * Fmax + fi) * D, x.data() + t * D, D * sizeof(float));
        topk_logsoftmax(logits.get() + t * Vd, Vd, k, ids.data() + t * k, lps.data() + t * k);
      }
#pragma omp single
      {
        for (int64_t b = 0; b < B; b++) {
          const int64_t c0 = made;
          for (int64_t i = 0; i < k; i++) {  // child j of frontier node i: candidate c0 + i k + j
            const int64_t f = front[b * k + i];
            for (int64_t j = 0; j < k; j++) {
              const int64_t c = b * C + c0 + i * k + j;
              ctok[c] = ids[(b * k + i) * k + j];
              cpar[c] = f;
              csc[c] = csc[b * C + f] + lps[(b * k + i) * k + j];
            }
          }
          best_k_sorted(csc.data() + b * C + c0, k * k, k, front.data() + b * k);
          for (int64_t i = 0; i < k; i++) front[b * k + i] += c0;
          kt_valid[slot[b]] = tstart[b] + F;  // every key the attention read is now in kt
        }
        made += k * k;
      }
    }
  }
  int64_t bad = 0;
  std::vector<int64_t> order(C), at(C);
  for (int64_t b = 0; b < B; b++) {
    const float* sc = csc.data() + b * C;
    for (int64_t i = 0; i < C; i++) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int64_t u, int64_t v) { return sc[u] > sc[v]; });
    std::vector<int64_t> keep(order.begin(), order.begin() + N);
    std::vector<int64_t> rk(C, -1);
    for (int64_t i = 0; i < N; i++) rk[order[i]] = i;
    std::sort(keep.begin(), keep.end());
    for (int64_t i = 0; i < C; i++) at[i] = -1;
    for (int64_t i = 0; i < N; i++) at[keep[i]] = i;
    for (int64_t i = 0; i < N; i++) {
      const int64_t c = keep[i], p = cpar[b * C + c];
      tok[b * N + i] = ctok[b * C + c];
      par[b * N + i] = p < 0 ? -1 : at[p];
      if (p >= 0 && at[p] < 0) bad = 1;
      score[b * N + i] = sc[c];
      rank[b * N + i] = rk[c];
    }
    kt_valid[slot[b]] = tstart[b];  // the drafted keys past the catch-up are scratch: the slot ends with its pairs
  }
  return bad ? -1 : N;
}

}  // extern "C"
