#!/usr/bin/env python3
"""The sm90 MLA decode kernel's consumer schedule (src/cuda/sm90/mla_kernel.cuh), modelled.

  model     a discrete-time model of both consumer warpgroups and the 2-stage ring: the
            steady-state time per 64-key tile, in U (one m64n64k16 bf16 wgmma at the full
            rate = 32 cycles; a tile is S 36 U + P V 2 x 16 U), for main's round order
            (P V of the other's tile, then S of the own tile, the other's tile released
            once S was issued: after the own stage landed), c0e7acf's 'landed' (S first
            when its stage has landed before the other's P arrived, else main's),
            'landed-rel' (in the P-first order P V waited on and the other's tile released
            before the wait for the own stage: two loads may be in flight) and both with
            the stage's column blocks in 3 groups with a full barrier each (S's k-steps
            issued per group as it lands; of L the last 60 % is the transfer, the groups
            landing evenly over it), over the load time L (a stage's release to its last
            block landed) and the owner's softmax + hand-over X. The tensor pipe is shared
            by processor sharing between the warpgroups with work; a warpgroup's wgmma
            groups run in issue order and are seen complete 2 U after their work (the
            pipeline's latency); a barrier wake costs 1 U, the order poll 0.5 U, reading
            the other's factor 2 U.
  protocol  a randomized interleaving check of the kernel's barrier protocol (the
            consumer loop as written, the producer's ring, a full barrier per column-block
            group): no deadlock, no mbarrier parity wait two phases behind, no stage
            reloaded before both releases, no S / P V before its groups landed, P read
            only after it was written and before its stage is reloaded, the rows' max and
            factor and the order slot read for the right tile / round.

  python3 bench/mla_schedule_model.py model [--L 45,65,80,100,120,140] [--X 15,20,30]
  python3 bench/mla_schedule_model.py protocol [--seeds 200] [--tiles 12]
"""
import argparse
import random

DT = 0.1


class Model:
    """parts: S's k-steps in groups, each gated by its own share of the stage: (how long
    before the whole stage that share lands, in U; its k-steps in U). One part: the whole
    stage, 36 U."""
    def __init__(self, n, L, lat=2.0, bar=1.0, parts=((0.0, 36),)):
        self.n, self.L, self.lat, self.bar, self.parts = n, L, lat, bar, parts
        self.flags, self.released, self.released_time = {}, {}, {}
        self.full = {t: L for t in range(min(2, n))}           # tile -> time it landed
        self.now = 0.0
        self.marks = {}

    def landed(self, t, early=0.0):
        return t in self.full and self.full[t] - early <= self.now

    def release(self, t):
        self.released[t] = self.released.get(t, 0) + 1
        if self.released[t] == 2:
            self.released_time[t] = self.now
            if t + 2 < self.n:
                self.full[t + 2] = self.now + self.L

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
                    elif k == 'issue':  # name, work, tile whose stage it needs[, how early its share lands]
                        if a[2] is not None and not self.landed(a[2], a[3] if len(a) > 3 else 0.0):
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


def consumer(m, c, n, X, order):
    """One consumer's rounds. order: 'main' (P V of the other's tile first, released after
    S(own) was issued), 'landed' (S first when its stage landed before the other's P, else
    main's), 'landed-rel' (this kernel: as 'landed', but in the P-first order P V is waited
    on and the other's tile released before the wait for the own stage)."""
    def p_ready(t):
        return ('P', t) in m.flags and m.flags[('P', t)] + m.bar <= m.now

    def issue_s(own):
        for early, work in m.parts:
            yield ('issue', 'S', work, own, early)

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
            if has_oth and order.startswith('landed'):
                while True:
                    yield ('cuda', 0.5)
                    if m.landed(own, m.parts[0][0]):
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
            elif order.endswith('-rel'):
                yield ('waitflag', ('P', oth))
                yield ('cuda', 2)
                yield ('issue', 'PVs', 16, oth)
                yield ('wait', 0)
                yield ('release', oth)
                yield from issue_s(own)
                yield ('wait', 0)
            else:
                yield ('waitflag', ('P', oth))
                yield ('cuda', 2)
                yield ('issue', 'PVs', 16, oth)
                yield from issue_s(own)
                yield ('wait', len(m.parts))
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


def tile_time(L, X, order, parts=1, xfer=0.6, n=48):
    """parts > 1: the stage's column blocks in `parts` equal groups, each with its own full
    barrier; of the load time L the last xfer is the transfer, the groups landing evenly
    over it (the rest: latency)."""
    shares = tuple((xfer * L * (parts - 1 - g) / parts, 36 / parts) for g in range(parts))
    m = Model(n, L, parts=shares)
    m.run([consumer(m, 0, n, X, order), consumer(m, 1, n, X, order)])
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


def protocol_run(n, seed, stages=2, ngroups=3):
    rnd = random.Random(seed)
    full = [[Bar(f'full{s}.{g}', 1) for g in range(ngroups)] for s in range(stages)]
    empty = [Bar(f'empty{s}', 2) for s in range(stages)]
    p_ready = [Bar(f'p_ready{c}', 1) for c in range(2)]
    holds = [[None] * ngroups for _ in range(stages)]  # per stage and group: the tile whose copy landed
    p_written, rows, slot, released = set(), [None, None], [[None, None], [None, None]], {}
    events, now = [], [0]

    def producer():
        for it in range(n):
            st, k = it % stages, it // stages
            while k > 0 and not empty[st].done(k - 1):
                yield
            assert k == 0 or released.get(it - stages, 0) == 2, 'stage reloaded before both releases'
            holds[st] = [None] * ngroups
            for g in range(ngroups):
                full[st][g].arrive(tx=1)

                def land(st=st, it=it, g=g):
                    holds[st][g] = it
                    if g == 0:
                        p_written.discard(it)
                    full[st][g].complete_tx(1)
                events.append((now[0] + rnd.randint(1, 30), land))
            yield

    def consumer_p(cw):
        other, groups, done_at = 1 - cw, [], [0]

        def issue(kind, t):
            g = {'kind': kind, 't': t, 'done': False}
            groups.append(g)

            def fin(g=g):
                assert all(h == g['t'] for h in holds[g['t'] % stages]), f'{g["kind"]} read a stage not holding its tile'
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
            for g in range(ngroups):  # a commit group per column-block group, once it landed
                while not full[own % stages][g].done(own // stages):
                    yield
                assert holds[own % stages][g] == own
            issue('S', own)  # (its reads checked when the last group completes)

        def take_over(t):
            while not p_ready[other].done(t // 2):
                yield
            assert rows[other] == t, f'rows of tile {rows[other]} read for tile {t}'

        def pv_shared(t):
            while not all(full[t % stages][g].done(t // stages) for g in range(ngroups)):
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
                    if full[own % stages][0].done(own // stages):
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
                    yield from wait(0)
                    release(oth)
                    yield from issue_s(own)
                    yield from wait(0)
            yield  # softmax; hand-over: P into the stage's rope block, the rows' arrays
            assert all(h == own for h in holds[own % stages])
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
    ap.add_argument('--L', default='45,65,80,100,120,140')
    ap.add_argument('--X', default='15,20,30')
    ap.add_argument('--seeds', type=int, default=200)
    ap.add_argument('--tiles', type=int, default=12)
    a = ap.parse_args()
    if a.what == 'model':
        Xs = [float(x) for x in a.X.split(',')]
        print('U per tile (tensor floor 68 U; shared-memory floor ~72 U)')
        print('| order | L | ' + ' | '.join(f'X {x:g}' for x in Xs) + ' |')
        print('|---|---|' + '---|' * len(Xs))
        for name, order, parts in (('main', 'main', 1), ('landed (c0e7acf)', 'landed', 1),
                                   ('landed-rel', 'landed-rel', 1), ('landed, 3 groups', 'landed', 3),
                                   ('landed-rel, 3 groups (this kernel)', 'landed-rel', 3)):
            for L in (float(x) for x in a.L.split(',')):
                print(f'| {name} | {L:g} | ' + ' | '.join(f'{tile_time(L, x, order, parts):.1f}' for x in Xs) + ' |')
    else:
        runs = 0
        for n in range(a.tiles + 1):
            for seed in range(a.seeds):
                protocol_run(n, seed)
                runs += 1
        print(f'protocol: {runs} randomized runs (0 .. {a.tiles} tiles), no violation')


if __name__ == '__main__':
    main()
