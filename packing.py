"""Best-fit decreasing bin packing: how --pack fills rows from each window of a source's document stream
(data.RealData.window, docs/data.md §10). A pure function of the lengths, so every rank packs alike."""
import bisect

NAME = "best-fit-decreasing"
WINDOW = 64   # documents a window: rows 96 % full on real-shaped data, next-fit's 79 % (bench/2026-11-28-data-speed.md)


def best_fit_decreasing(lengths, capacity):
    """lengths (each at most capacity) -> rows: lists of indices into lengths, every index in exactly one, each row's
    lengths adding up to at most capacity. Longest first (ties: the lower index), each into the open row with the
    least room left that still holds it (ties: the row opened first), else into a new row. The rows come ordered by
    their lowest index, the indices of a row ascending, so rows read in the order of what they pack."""
    rows, rooms = [], []                            # rooms: (room left, row) in ascending order
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(rooms, (lengths[i], -1))   # the least room >= lengths[i], the first row of it
        if at < len(rooms):
            room, r = rooms.pop(at)
            rows[r].append(i)
        else:
            room, r = capacity, len(rows)
            rows.append([i])
        bisect.insort(rooms, (room - lengths[i], r))
    return sorted((sorted(row) for row in rows), key=lambda row: row[0])
