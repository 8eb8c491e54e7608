"""Trace which head element each half of the int4 operand registers holds (new decode), vs elem_of / col_of."""
import random
import sys

D = int(sys.argv[1]) if len(sys.argv) > 1 else 128
row_bytes = D // 2
kKBytes = row_bytes // 4
kVBytes = row_bytes // 8
kSteps = D // 16
M = 0x64006400

def byte_perm(x, y, s):
    b = [(x >> (8 * i)) & 0xff for i in range(4)] + [(y >> (8 * i)) & 0xff for i in range(4)]
    return sum(b[(s >> (4 * i)) & 7] << (8 * i) for i in range(4))

def lop(w, mask): return (w & mask) | M
def halves(r): return r & 0xffff, r >> 16
def decode(h):  # float16 value of 0x64xx pattern: 1024 + mantissa
    assert h >> 10 == 0x19, hex(h)
    return 1024 + (h & 0x3ff)

def elem_of(t, s, i): return (s % 2) * (D // 2) + t * (D // 8) + 4 * (s // 2) + (i % 2) * 2 + i // 2
def col_of(n, j): return (j % 2) * (D // 2) + n * (D // 16) + j // 2

def words(row, off, nbytes):
    return [sum(row[off + 4 * w + i] << (8 * i) for i in range(4)) for w in range(nbytes // 4)]

random.seed(1)
for trial in range(50):
    rows = [[random.randrange(256) for _ in range(row_bytes)] for _ in range(16)]  # 16 tokens
    def val(token, e):  # the code of element e of token (devices/cache.py int4 layout)
        j = e % (D // 2)
        return rows[token][j] & 0xf if e < D // 2 else rows[token][j] >> 4
    # K: lane (g, t), token g (r = 0) / g + 8 (r = 1): a0/a1 slots (2t, 2t+1), a2/a3 slots (2t+8, 2t+9)
    for g in range(8):
        for t in range(4):
            for r in range(2):
                token = g + 8 * r
                kw = words(rows[token], t * kKBytes, kKBytes)
                for s in range(kSteps):
                    x = kw[s // 2]
                    mask = 0x00F000F0 if s % 2 else 0x000F000F
                    b0, b1 = lop(x, mask), lop(x >> 8, mask)
                    scale = 16 if s % 2 else 1
                    for slot_pair, reg in ((0, b0), (1, b1)):
                        for half, h in enumerate(halves(reg)):
                            i = 2 * slot_pair + half
                            e = elem_of(t, s, i)
                            assert decode(h) == 1024 + scale * val(token, e), (g, t, r, s, i)
    # V: lane (g, t): tokens 2t, 2t+1 (pair 01), 2t+8, 2t+9 (pair 23); m-tile j: regs (2j: row g, 2j+1: row g+8)
    for g in range(8):
        for t in range(4):
            vw = [words(rows[tok], g * kVBytes, kVBytes) for tok in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)]
            toks = [(2 * t, 2 * t + 1), (2 * t + 8, 2 * t + 9)]
            for pair, (a, b) in enumerate(((vw[0], vw[1]), (vw[2], vw[3]))):
                for jj in range(2 * kSteps):
                    byte = jj // 2
                    xy = byte_perm(a[byte // 4], b[byte // 4], 0x5410 if byte % 4 < 2 else 0x7632)
                    if byte % 2:
                        xy >>= 8
                    reg = lop(xy, 0x00F000F0 if jj % 2 else 0x000F000F)
                    scale = 16 if jj % 2 else 1
                    e = col_of(g, jj)
                    for half, h in enumerate(halves(reg)):
                        assert decode(h) == 1024 + scale * val(toks[pair][half], e), (g, t, pair, jj, half)
    # every element covered exactly once by (t, s, i) and by (g, jj)
assert sorted(elem_of(t, s, i) for t in range(4) for s in range(kSteps) for i in range(4)) == list(range(D))
assert sorted(col_of(g, jj) for g in range(8) for jj in range(2 * kSteps)) == list(range(D))
print('ok', D)
