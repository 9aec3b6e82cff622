/* The one visibility rule of causal and window attention, which every kernel's key and row ranges,
 * edge tests and per-element hiding derive from.
 *
 * Query position pos (query index + offset) sees key k iff
 *     pos - left <= k <= pos + right,
 * a band around the diagonal: left = window_left, unbounded when window_left < 0; right = 0 when
 * causal, else window_right, unbounded when window_right < 0 (causal with a right window is the
 * smaller of the two, 0, since window_right >= 0).  key_lengths cuts each batch row's keys
 * separately (visible_keys, the backward's live_keys); mask arrays are mask_tiles.h's.
 *
 * Its projections:
 *   - the keys positions first..last can see: [first - left, last + right]   (cut_keys, key_end);
 *   - the positions keys first..last are seen by: [first - right, last + left] (cut_positions,
 *     first_position, last_position);
 *   - whether a tile of keys hides some key from some of its rows, so that per-element hiding runs
 *     only on tiles astride an edge (edges);
 *   - the per-element test (within_left, within_right), in the compute type as the positions are.
 */
#ifndef FASTATTN_VISIBILITY_H
#define FASTATTN_VISIBILITY_H

#include <algorithm>
#include <cstdint>

#include "isa.h"
#include "params.h"

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {

/* Which sides of the band cut a tile of keys [kt, kt + n) for positions first..last. */
struct BandEdges {
    bool left, right;
    bool any() const { return left || right; }
};

struct Band {
    bool has_left, has_right;
    int64_t left, right;

    explicit Band(const FwdParams& p)
        : has_left(p.window_left >= 0),
          has_right(p.causal || p.window_right >= 0),
          left(p.window_left),
          right(p.causal ? 0 : p.window_right) {}

    /* The first key position pos sees (has_left), and one past its last (has_right). */
    int64_t key_begin(int64_t pos) const { return pos - left; }
    int64_t key_end(int64_t pos) const { return pos + right + 1; }

    /* [*lo, *hi) cut to the keys some position of first_pos..last_pos can see. */
    void cut_keys(int64_t first_pos, int64_t last_pos, int64_t* lo, int64_t* hi) const {
        if (has_left) *lo = std::max(*lo, key_begin(first_pos));
        if (has_right) *hi = std::min(*hi, key_end(last_pos));
    }

    /* The first position that sees key `key` (has_right), and the last (has_left). */
    int64_t first_position(int64_t key) const { return key - right; }
    int64_t last_position(int64_t key) const { return key + left; }

    /* [*lo, *hi) cut to the positions that see some key of first_key..last_key. */
    void cut_positions(int64_t first_key, int64_t last_key, int64_t* lo, int64_t* hi) const {
        if (has_right) *lo = std::max(*lo, first_position(first_key));
        if (has_left) *hi = std::min(*hi, last_position(last_key) + 1);
    }

    /* Whether the band hides some of the keys [kt, kt + n) from some position of first..last, by side. */
    BandEdges edges(int64_t kt, int64_t n, int64_t first_pos, int64_t last_pos) const {
        return {has_left && kt < last_pos - left, has_right && kt + n - 1 > first_pos + right};
    }

    /* Key `key` is not left of position pos's band (within_left), not right of it (within_right); X is
     * the compute type or its vector, `lhs` and `rhs` left and right in it. */
    template <typename X> static auto within_left(X key, X pos, X lhs) { return key >= pos - lhs; }
    template <typename X> static auto within_right(X key, X pos, X rhs) { return key <= pos + rhs; }
};

}  // namespace FASTATTN_ISA_NAMESPACE
}  // namespace fastattn

#endif
