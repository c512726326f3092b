#!/usr/bin/env python3
"""The sm90 MLA decode kernel's consumer schedule (src/cuda/sm90/mla_kernel.cuh), modelled.

  model     a discrete-time model of both consumer warpgroups and the 2-stage ring: the
            steady-state time per 64-key tile, in U (one m64n64k16 bf16 wgmma at the full
            rate = 32 cycles; a tile is S 36 U + P V 2 x 16 U), for main's round order
            (P V of the other's tile, then S of the own tile), this kernel's (S first when
            its stage has landed before the other's P arrived) and a variant with the
            stage's full barrier split in two (S's first 20 k-steps on the first 5 column
            blocks), over the load time L (a stage's release to its full barrier) and the
            owner's softmax + hand-over X. The tensor pipe is shared by processor sharing
            between the warpgroups with work; a warpgroup's wgmma groups run in issue order
            and are seen complete 2 U after their work (the pipeline's latency); a barrier
            wake costs 1 U, the order poll 0.5 U, reading the other's factor 2 U.
  protocol  a randomized interleaving check of the kernel's barrier protocol (the
            consumer loop as written, the producer's ring): no deadlock, no mbarrier
            parity wait two phases behind, no stage reloaded before both releases, P read
            only after it was written and before its stage is reloaded, the rows' max and
            factor and the order slot read for the right tile / round.

  python3 bench/mla_schedule_model.py model [--L 25,35,45,55,65,80] [--X 15,20,30]
  python3 bench/mla_schedule_model.py protocol [--seeds 200] [--tiles 12]
"""
import argparse
import random

DT = 0.1


class Model:
    def __init__(self, n, L, lat=2.0, bar=1.0, early_a=0.0):
        self.n, self.L, self.lat, self.bar = n, L, lat, bar
        self.flags, self.released, self.released_time = {}, {}, {}
        self.full = {t: L for t in range(min(2, n))}           # tile -> time it landed
        self.full_a = {t: v - early_a for t, v in self.full.items()}
        self.early_a = early_a
        self.now = 0.0
        self.marks = {}

    def landed(self, t, part_a=False):
        d = self.full_a if part_a else self.full
        return t in d and d[t] <= self.now

    def release(self, t):
        self.released[t] = self.released.get(t, 0) + 1
        if self.released[t] == 2:
            self.released_time[t] = self.now
            if t + 2 < self.n:
                self.full[t + 2] = self.now + self.L
                self.full_a[t + 2] = self.full[t + 2] - self.early_a

    def run(self, progs):
        wgs = [{'prog': p, 'groups': [], 'until': 0.0, 'op': None, 'done': False} for p in progs]
        while not all(w['done'] for w in wgs):
            for w in wgs:
                while not w['done'] and self.now >= w['until']:
                    if w['op'] is None:
                        try:
                            w['op'] = next(w['prog'])
                        except StopIteration:
                            w['done'] = True
                            break
                    k, *a = w['op']
                    if k == 'cuda':
                        w['until'] = self.now + a[0]
                    elif k == 'issue':  # name, work, tile whose (whole) stage it needs
                        if a[2] is not None and not self.landed(a[2]):
                            break
                        w['groups'].append([a[1], None])
                        w['until'] = self.now + 0.3
                    elif k == 'wait':
                        if sum(1 for g in w['groups'] if g[1] is None or g[1] > self.now) > a[0]:
                            break
                    elif k == 'arrive':
                        self.flags[a[0]] = self.now
                    elif k == 'waitflag':
                        if a[0] not in self.flags or self.flags[a[0]] + self.bar > self.now:
                            break
                    elif k == 'release':
                        self.release(a[0])
                    elif k == 'mark':
                        self.marks[a[0]] = self.now
                    w['op'] = None
            active = [next(g for g in w['groups'] if g[0] > 0) for w in wgs if any(g[0] > 0 for g in w['groups'])]
            for g in active:
                g[0] -= DT / len(active)
                if g[0] <= 1e-9:
                    g[1] = self.now + self.lat
            self.now += DT
            if self.now > 1e6:
                raise RuntimeError('model deadlock')


def consumer(m, c, n, X, order, split_s=False):
    """One consumer's rounds. order: 'main' (P V of the other's tile first), 'landed' (this
    kernel: S first when its stage landed before the other's P)."""
    def p_ready(t):
        return ('P', t) in m.flags and m.flags[('P', t)] + m.bar <= m.now

    def issue_s(own):
        if split_s:
            while not m.landed(own, part_a=True):
                yield ('cuda', DT)
            yield ('issue', 'Sa', 20, None)
            yield ('issue', 'Sb', 16, own)
        else:
            yield ('issue', 'S', 36, own)

    def prog():
        own = c
        while True:
            oth = own - 1
            has_oth = 0 <= oth < n
            if own >= n:
                if has_oth:
                    yield ('waitflag', ('P', oth))
                    yield ('cuda', 2)
                    yield ('issue', 'PVs', 16, oth)
                    yield ('wait', 0)
                    yield ('release', oth)
                return
            s_first = False
            if has_oth and order == 'landed':
                while True:
                    yield ('cuda', 0.5)
                    if m.landed(own, part_a=split_s):
                        s_first = not p_ready(oth)
                        break
                    if p_ready(oth):
                        break
            if not has_oth:
                yield from issue_s(own)
                yield ('wait', 0)
            elif s_first:
                yield from issue_s(own)
                yield ('waitflag', ('P', oth))
                yield ('cuda', 2)
                yield ('issue', 'PVs', 16, oth)
                yield ('wait', 1)
            else:
                yield ('waitflag', ('P', oth))
                yield ('cuda', 2)
                yield ('issue', 'PVs', 16, oth)
                yield from issue_s(own)
                yield ('wait', 1)  # (with S in two groups: P V and S's first part)
                yield ('release', oth)
                yield ('wait', 0)
            yield ('mark', own)
            yield ('cuda', X)
            yield ('arrive', ('P', own))
            yield ('wait', 0)
            if s_first:
                yield ('release', oth)
            yield ('issue', 'PVo', 16, None)
            yield ('wait', 0)
            yield ('release', own)
            own += 2
    return prog()


def tile_time(L, X, order, split_s=False, n=48):
    m = Model(n, L, early_a=0.27 * L if split_s else 0.0)
    m.run([consumer(m, 0, n, X, order, split_s), consumer(m, 1, n, X, order, split_s)])
    a, b = n // 4, 3 * n // 4
    return (m.marks[b] - m.marks[a]) / (b - a)


# ---------------------------------------------------------------- protocol check

class Bar:
    def __init__(self, name, count):
        self.name, self.count, self.pending, self.phase, self.tx = name, count, count, 0, 0

    def arrive(self, tx=0):
        self.pending -= 1
        self.tx += tx
        assert self.pending >= 0, self.name
        self._advance()

    def complete_tx(self, tx):
        self.tx -= tx
        self._advance()

    def _advance(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def done(self, k):
        # The hardware tests the parity of phase k: right only while at most one phase past.
        if self.phase > k:
            assert self.phase == k + 1, f'{self.name}: waits on phase {k}, barrier at {self.phase}'
            return True
        return False


def protocol_run(n, seed, stages=2):
    rnd = random.Random(seed)
    full = [Bar(f'full{s}', 1) for s in range(stages)]
    empty = [Bar(f'empty{s}', 2) for s in range(stages)]
    p_ready = [Bar(f'p_ready{c}', 1) for c in range(2)]
    holds = [None] * stages  # the tile whose copy landed in the stage
    p_written, rows, slot, released = set(), [None, None], [[None, None], [None, None]], {}
    events, now = [], [0]

    def producer():
        for it in range(n):
            st, k = it % stages, it // stages
            while k > 0 and not empty[st].done(k - 1):
                yield
            assert k == 0 or released.get(it - stages, 0) == 2, 'stage reloaded before both releases'
            holds[st] = None
            full[st].arrive(tx=1)

            def land(st=st, it=it):
                holds[st] = it
                p_written.discard(it)
                full[st].complete_tx(1)
            events.append((now[0] + rnd.randint(1, 30), land))
            yield

    def consumer_p(cw):
        other, groups, done_at = 1 - cw, [], [0]

        def issue(kind, t):
            g = {'kind': kind, 't': t, 'done': False}
            groups.append(g)

            def fin(g=g):
                assert holds[g['t'] % stages] == g['t'], f'{g["kind"]} read a stage not holding its tile'
                assert g['kind'] != 'PVs' or g['t'] in p_written, 'P V read a P not written'
                g['done'] = True
            done_at[0] = max(now[0], done_at[0]) + rnd.randint(1, 20)  # in issue order
            events.append((done_at[0], fin))

        def wait(left):
            while sum(1 for g in groups if not g['done']) > left:
                yield
            groups[:] = [g for g in groups if not g['done']]

        def release(t):
            released[t] = released.get(t, 0) + 1
            empty[t % stages].arrive()

        def issue_s(own):
            while not full[own % stages].done(own // stages):
                yield
            issue('S', own)

        def take_over(t):
            while not p_ready[other].done(t // 2):
                yield
            assert rows[other] == t, f'rows of tile {rows[other]} read for tile {t}'

        def pv_shared(t):
            while not full[t % stages].done(t // stages):
                yield
            issue('PVs', t)

        own = cw
        while True:
            oth = own - 1
            has_oth = 0 <= oth < n
            if own >= n:
                if has_oth:
                    yield from take_over(oth)
                    yield from pv_shared(oth)
                    yield from wait(0)
                    release(oth)
                return
            held = False
            if not has_oth:
                yield from issue_s(own)
                yield from wait(0)
            else:
                while True:  # s_goes_first: one thread polls, the warpgroup reads the slot
                    if full[own % stages].done(own // stages):
                        first = True
                        break
                    if p_ready[other].done(oth // 2):
                        first = False
                        break
                    yield
                slot[cw][(own // 2) & 1] = (own, first)
                yield
                assert slot[cw][(own // 2) & 1][0] == own, 'order slot of another round'
                if first:
                    yield from issue_s(own)
                    yield from take_over(oth)
                    yield from pv_shared(oth)
                    while not groups[0]['done']:  # wait<1>: S, the older group
                        yield
                    held = True
                else:
                    yield from take_over(oth)
                    yield from pv_shared(oth)
                    yield from issue_s(own)
                    yield from wait(1)
                    release(oth)
                    yield from wait(0)
            yield  # softmax; hand-over: P into the stage's rope block, the rows' arrays
            assert holds[own % stages] == own
            p_written.add(own)
            rows[cw] = own
            p_ready[cw].arrive()
            yield from wait(0)
            if held:
                release(oth)
            issue('PVo', own)
            yield from wait(0)
            release(own)
            own += 2

    procs, alive, idle = [producer(), consumer_p(0), consumer_p(1)], [True] * 3, 0
    while any(alive) or events:
        for i in rnd.sample(range(3), 3):
            if alive[i] and rnd.random() < 0.5:
                try:
                    next(procs[i])
                except StopIteration:
                    alive[i] = False
        events.sort(key=lambda e: e[0])
        fired = False
        while events and events[0][0] <= now[0]:
            events.pop(0)[1]()
            fired = True
        now[0] += 1
        idle = 0 if fired or events else idle + 1
        if idle > 10000:
            raise RuntimeError(f'deadlock: {n} tiles, seed {seed}')
    assert all(released.get(t, 0) == 2 for t in range(n)), 'a tile not released by both'


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('what', choices=['model', 'protocol'])
    ap.add_argument('--L', default='25,35,45,55,65,80')
    ap.add_argument('--X', default='15,20,30')
    ap.add_argument('--seeds', type=int, default=200)
    ap.add_argument('--tiles', type=int, default=12)
    a = ap.parse_args()
    if a.what == 'model':
        Xs = [float(x) for x in a.X.split(',')]
        print('U per tile (tensor floor 68 U; shared-memory floor ~72 U)')
        print('| order | L | ' + ' | '.join(f'X {x:g}' for x in Xs) + ' |')
        print('|---|---|' + '---|' * len(Xs))
        for name, order, split in (('main', 'main', False), ('landed (this kernel)', 'landed', False),
                                   ('landed, S split in 2', 'landed', True)):
            for L in (float(x) for x in a.L.split(',')):
                print(f'| {name} | {L:g} | ' + ' | '.join(f'{tile_time(L, x, order, split):.1f}' for x in Xs) + ' |')
    else:
        runs = 0
        for n in range(a.tiles + 1):
            for seed in range(a.seeds):
                protocol_run(n, seed)
                runs += 1
        print(f'protocol: {runs} randomized runs (0 .. {a.tiles} tiles), no violation')


if __name__ == '__main__':
    main()
