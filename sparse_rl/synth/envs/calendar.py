"""A booking/calendar API with state and rules: list_events, create_event, cancel_event, move_event.

Rules every change must respect (a violating call is refused with the reason): events lie within
office hours (09:00-17:00), start on a 30-minute grid, last at most `max_minutes`, have at least
one attendee, and no attendee is double-booked. Days are Mon..Fri of one week.
"""

from __future__ import annotations

import copy
import json
import random

from sparse_rl.synth.envs.base import Env, ToolError
from sparse_rl.synth.schema import tool

DAYS = ["Mon", "Tue", "Wed", "Thu", "Fri"]
PEOPLE = ["ana", "ben", "chen", "dara", "eli", "femi", "gita", "hugo", "iris", "jack"]
TITLES = ["Standup", "Design review", "1:1", "Planning", "Retro", "Demo", "Hiring panel", "Budget", "Offsite prep"]
OPEN, CLOSE, GRID = 9 * 60, 17 * 60, 30


def hm(t: int) -> str:
    return f"{t // 60:02d}:{t % 60:02d}"


def mins(s: str) -> int:
    try:
        h, m = s.split(":")
        return int(h) * 60 + int(m)
    except ValueError:
        raise ToolError(f"time {s!r}: expected HH:MM") from None


class CalendarEnv(Env):
    name = "calendar"
    mutating = frozenset({"create_event", "cancel_event", "move_event"})

    def __init__(self, state: dict):
        super().__init__(state)
        self.events: list[dict] = copy.deepcopy(state["events"])
        self.max_minutes = state.get("max_minutes", 120)
        self.next_id = max([e["id"] for e in self.events], default=0) + 1

    @classmethod
    def tools(cls) -> list[dict]:
        day = {"type": "string", "enum": DAYS}
        hhmm = {"type": "string", "description": "HH:MM, 24-hour"}
        return [
            tool("list_events", "List events on a day, optionally only those of one person.",
                 {"day": day, "person": {"type": "string"}}, required=["day"]),
            tool("create_event", "Create an event; refused if it breaks a rule.",
                 {"title": {"type": "string"}, "day": day, "start": hhmm, "end": hhmm,
                  "attendees": {"type": "array", "items": {"type": "string"}}}),
            tool("cancel_event", "Cancel an event by id.", {"event_id": {"type": "integer"}}),
            tool("move_event", "Move an event to a new day and start time, keeping its duration.",
                 {"event_id": {"type": "integer"}, "day": day, "start": hhmm}),
        ]

    def _get(self, event_id: int) -> dict:
        for e in self.events:
            if e["id"] == event_id:
                return e
        raise ToolError(f"no event with id {event_id}")

    def _validate(self, ev: dict, ignore_id: int | None = None) -> None:
        s, e = mins(ev["start"]), mins(ev["end"])
        if e <= s:
            raise ToolError("the end must be after the start")
        if s < OPEN or e > CLOSE:
            raise ToolError("events must lie within office hours 09:00-17:00")
        if s % GRID or e % GRID:
            raise ToolError("events start and end on the hour or half hour")
        if e - s > self.max_minutes:
            raise ToolError(f"events last at most {self.max_minutes} minutes")
        if not ev["attendees"]:
            raise ToolError("an event needs at least one attendee")
        unknown = [a for a in ev["attendees"] if a not in PEOPLE]
        if unknown:
            raise ToolError(f"unknown attendee(s) {', '.join(unknown)}")
        for o in self.events:
            if o["id"] == ignore_id or o["day"] != ev["day"]:
                continue
            if mins(o["start"]) < e and s < mins(o["end"]):
                both = sorted(set(o["attendees"]) & set(ev["attendees"]))
                if both:
                    raise ToolError(f"conflict: {', '.join(both)} already in event {o['id']} "
                                    f"'{o['title']}' {o['start']}-{o['end']}")

    def tool_list_events(self, day: str, person: str | None = None) -> str:
        evs = sorted((e for e in self.events if e["day"] == day and (person is None or person in e["attendees"])),
                     key=lambda e: (e["start"], e["id"]))
        return "\n".join(json.dumps(e) for e in evs) or "no events"

    def tool_create_event(self, title: str, day: str, start: str, end: str, attendees: list[str]) -> str:
        ev = {"id": self.next_id, "title": title, "day": day, "start": start, "end": end,
              "attendees": sorted(set(attendees))}
        self._validate(ev)
        self.events.append(ev)
        self.next_id += 1
        return f"created event {ev['id']}"

    def tool_cancel_event(self, event_id: int) -> str:
        self.events.remove(self._get(event_id))
        return f"cancelled event {event_id}"

    def tool_move_event(self, event_id: int, day: str, start: str) -> str:
        ev = self._get(event_id)
        dur = mins(ev["end"]) - mins(ev["start"])
        new = {**ev, "day": day, "start": start, "end": hm(mins(start) + dur)}
        self._validate(new, ignore_id=event_id)
        ev.update(new)
        return f"moved event {event_id} to {day} {new['start']}-{new['end']}"

    def check(self, spec: dict) -> bool:
        kind = spec["kind"]
        if kind == "event":  # exactly one event matching every given field
            want = spec["match"]
            hits = [e for e in self.events
                    if all((sorted(e[k]) == sorted(v)) if k == "attendees" else e[k] == v for k, v in want.items())]
            return len(hits) == 1
        if kind == "absent":
            return all(e["id"] != spec["id"] for e in self.events)
        if kind == "valid":  # the whole calendar still respects every rule
            try:
                for ev in self.events:
                    self._validate(ev, ignore_id=ev["id"])
            except ToolError:
                return False
            return True
        raise ValueError(f"calendar env: unknown check {kind!r}")


# ------------------------------------------------------------------------------------- tasks


def _busy(events, day, people):
    return [(mins(e["start"]), mins(e["end"])) for e in events if e["day"] == day and set(e["attendees"]) & set(people)]


def _earliest(events, day, people, dur):
    busy = _busy(events, day, people)
    for s in range(OPEN, CLOSE - dur + 1, GRID):
        if all(not (bs < s + dur and s < be) for bs, be in busy):
            return s
    return None


def _random_events(rng: random.Random, n: int, days: list[str]) -> list[dict]:
    events: list[dict] = []
    eid = 1
    for _ in range(n * 4):
        if len(events) >= n:
            break
        day = rng.choice(days)
        dur = rng.choice([30, 60, 90])
        s = rng.randrange(OPEN, CLOSE - dur + 1, GRID)
        att = sorted(rng.sample(PEOPLE, rng.randint(1, 3)))
        if any(e["day"] == day and mins(e["start"]) < s + dur and s < mins(e["end"]) and set(e["attendees"]) & set(att)
               for e in events):
            continue
        events.append({"id": eid, "title": rng.choice(TITLES), "day": day, "start": hm(s), "end": hm(s + dur),
                       "attendees": att})
        eid += 1
    return events


def _gen_schedule(rng: random.Random, level: int) -> dict:
    day = rng.choice(DAYS)
    events = _random_events(rng, 4 + 4 * level, [day] + rng.sample(DAYS, 2))
    people = sorted(rng.sample(PEOPLE, 2 + min(level, 4) // 2))
    dur = rng.choice([30, 60, 90] if level >= 2 else [30, 60])
    start = _earliest(events, day, people, dur)
    if start is None:
        return {}
    title = f"Sync {rng.randint(100, 999)}"
    ev = {"title": title, "day": day, "start": hm(start), "end": hm(start + dur), "attendees": people}
    prompt = (f"Schedule a {dur}-minute meeting titled '{title}' with {', '.join(people)} on {day} at the earliest "
              f"time when all of them are free (office hours 09:00-17:00, meetings start on the hour or half hour). "
              f"Reply with the start time as HH:MM.")
    return {"prompt": prompt, "answer": hm(start), "answer_kind": "time",
            "state": {"events": events, "max_minutes": 120},
            "solution": [{"name": "list_events", "arguments": {"day": day}},
                         {"name": "create_event", "arguments": ev}],
            "checks": [{"kind": "event", "match": ev}, {"kind": "valid"}]}


def _gen_reschedule(rng: random.Random, level: int) -> dict:
    days = rng.sample(DAYS, 2)
    events = _random_events(rng, 4 + 4 * level, days)
    movable = [e for e in events if e["day"] == days[0]]
    if not movable:
        return {}
    ev = rng.choice(movable)
    solution: list[dict] = []
    checks: list[dict] = []
    extra = ""
    work = copy.deepcopy(events)
    if level >= 3:  # composition: first cancel another event, which may free the slot
        others = [e for e in events if e["day"] == days[1]]
        if others:
            gone = rng.choice(others)
            extra = f" First cancel event {gone['id']} ('{gone['title']}'), which was called off."
            solution.append({"name": "cancel_event", "arguments": {"event_id": gone["id"]}})
            checks.append({"kind": "absent", "id": gone["id"]})
            work = [e for e in work if e["id"] != gone["id"]]
    dur = mins(ev["end"]) - mins(ev["start"])
    start = _earliest([e for e in work if e["id"] != ev["id"]], days[1], ev["attendees"], dur)
    if start is None:
        return {}
    prompt = (f"Event {ev['id']} ('{ev['title']}' on {days[0]}) has to move to {days[1]}.{extra} Move it to the "
              f"earliest start time on {days[1]} when all its attendees are free, keeping its length "
              f"(office hours 09:00-17:00, on the hour or half hour). Reply with the new start time as HH:MM.")
    solution += [{"name": "list_events", "arguments": {"day": days[1]}},
                 {"name": "move_event", "arguments": {"event_id": ev["id"], "day": days[1], "start": hm(start)}}]
    checks += [{"kind": "event", "match": {"id": ev["id"], "day": days[1], "start": hm(start)}}, {"kind": "valid"}]
    return {"prompt": prompt, "answer": hm(start), "answer_kind": "time",
            "state": {"events": events, "max_minutes": 120}, "solution": solution, "checks": checks}


TEMPLATES = {"schedule": _gen_schedule, "reschedule": _gen_reschedule}
