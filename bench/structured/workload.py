"""Schema-heavy structured-output cases shared by bench/structured/grammar_mask.py and
bench/structured/run.py.

Each case is an extraction task as users send them with `response_format: json_schema`: a
paragraph of text and a schema with many keys (nested objects, arrays of objects, enums, free-text
strings, integers and numbers), plus a reference object — what a careful reader would extract,
valid against the schema. bench/structured/grammar_mask.py walks the grammar libraries through
the reference objects' JSON; bench/structured/run.py sends the paragraphs to the model. Kept free
of I/O so tests can check every reference against its schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The engine's JSON separators (engine/structured/compiler.py): what both libraries are asked for.
SEPARATORS = (", ", ": ")


def obj(**properties: Any) -> dict[str, Any]:
    """An object schema whose keys are all required, in order, and nothing else."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def array(items: dict[str, Any], min_items: int = 1) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": min_items}


def enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


STR = {"type": "string"}
INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}


@dataclass(frozen=True)
class Case:
    """One extraction task: the instruction, its paragraph, the schema and a valid answer."""

    name: str
    instruction: str
    passage: str
    schema: dict[str, Any]
    reference: dict[str, Any]

    def messages(self) -> list[dict[str, str]]:
        """The chat request: the instruction, the schema and the paragraph to extract from."""
        schema = json.dumps(self.schema, ensure_ascii=False)
        text = (
            f"{self.instruction} Reply with JSON matching this schema: {schema}\n\n{self.passage}"
        )
        return [{"role": "user", "content": text}]


def canonical_json(value: Any, separators: tuple[str, str] = SEPARATORS) -> str:
    """The one text a compact grammar with these separators allows for `value`."""
    return json.dumps(value, ensure_ascii=False, separators=separators)


CONTACT = Case(
    "contact",
    "Extract the sender's contact card from this email signature.",
    "Best regards,\nDr. Ingrid Solberg-Müller\nHead of Data Platform, Nordlys Analytics AS\n"
    "Mobile +47 912 34 567, office +47 22 98 76 00\ningrid.solberg@nordlys.example\n"
    "Karl Johans gate 12, 0154 Oslo, Norway\nI read email once a day; call my mobile if urgent.",
    obj(
        name=STR,
        title=STR,
        company=STR,
        email=STR,
        phones=array(obj(kind=enum("mobile", "work", "home"), number=STR)),
        address=obj(street=STR, postal_code=STR, city=STR, country=STR),
        preferred_contact=enum("email", "phone", "either"),
    ),
    {
        "name": "Dr. Ingrid Solberg-Müller",
        "title": "Head of Data Platform",
        "company": "Nordlys Analytics AS",
        "email": "ingrid.solberg@nordlys.example",
        "phones": [
            {"kind": "mobile", "number": "+47 912 34 567"},
            {"kind": "work", "number": "+47 22 98 76 00"},
        ],
        "address": {
            "street": "Karl Johans gate 12",
            "postal_code": "0154",
            "city": "Oslo",
            "country": "Norway",
        },
        "preferred_contact": "phone",
    },
)

INVOICE = Case(
    "invoice",
    "Extract the invoice in this message.",
    "Invoice INV-2024-0917 was issued on 17 September 2024 to Brightwater Cafe Ltd (VAT GB "
    "293847561). It bills 12 kg of house espresso beans at 18.50 GBP per kg, 3 replacement "
    "portafilter baskets at 9.95 each and one grinder service visit at 85.00, 336.85 GBP in "
    "total. Payment is due within 30 days and has not been received yet.",
    obj(
        invoice_number=STR,
        issue_date=STR,
        currency=enum("EUR", "USD", "GBP"),
        customer=obj(name=STR, vat_id=STR),
        items=array(obj(description=STR, quantity=INT, unit=STR, unit_price=NUM)),
        total=NUM,
        payment_terms_days=INT,
        paid=BOOL,
    ),
    {
        "invoice_number": "INV-2024-0917",
        "issue_date": "2024-09-17",
        "currency": "GBP",
        "customer": {"name": "Brightwater Cafe Ltd", "vat_id": "GB 293847561"},
        "items": [
            {
                "description": "house espresso beans",
                "quantity": 12,
                "unit": "kg",
                "unit_price": 18.5,
            },
            {
                "description": "replacement portafilter basket",
                "quantity": 3,
                "unit": "piece",
                "unit_price": 9.95,
            },
            {
                "description": "grinder service visit",
                "quantity": 1,
                "unit": "visit",
                "unit_price": 85.0,
            },
        ],
        "total": 336.85,
        "payment_terms_days": 30,
        "paid": False,
    },
)

INCIDENT = Case(
    "incident",
    "Turn this incident write-up into a structured incident report.",
    "At 09:12 UTC the checkout API began returning 502s for about a third of requests. On-call "
    "(Priya) was paged at 09:15 and found the payments connection pool exhausted after the "
    "09:00 deploy raised the request timeout from 2 s to 30 s, so slow calls to the card "
    "processor held connections for longer. The deploy was rolled back at 09:41 and errors "
    "stopped by 09:44. Checkout and the order-status page were affected; search was not. "
    "Follow-ups: Priya adds a pool-saturation alert by Friday; Tom caps per-call timeouts in "
    "the payments client by next sprint.",
    obj(
        title=STR,
        severity=enum("sev1", "sev2", "sev3", "sev4"),
        status=enum("investigating", "mitigated", "resolved"),
        affected_services=array(STR),
        timeline=array(obj(time=STR, event=STR), min_items=2),
        root_cause=STR,
        follow_ups=array(obj(owner=STR, action=STR, due=STR)),
    ),
    {
        "title": "Checkout API 502s from exhausted payments connection pool",
        "severity": "sev2",
        "status": "resolved",
        "affected_services": ["checkout", "order-status page"],
        "timeline": [
            {"time": "09:00", "event": "Deploy raises request timeout from 2 s to 30 s"},
            {"time": "09:12", "event": "Checkout API starts returning 502s"},
            {"time": "09:15", "event": "On-call paged"},
            {"time": "09:41", "event": "Deploy rolled back"},
            {"time": "09:44", "event": "Errors stop"},
        ],
        "root_cause": "A 30 s timeout let slow card-processor calls hold payments pool "
        "connections until the pool was exhausted.",
        "follow_ups": [
            {"owner": "Priya", "action": "Add a pool-saturation alert", "due": "Friday"},
            {
                "owner": "Tom",
                "action": "Cap per-call timeouts in the payments client",
                "due": "next sprint",
            },
        ],
    },
)

RECIPE = Case(
    "recipe",
    "Extract the recipe.",
    "Lemon lentil soup, serves 4, about 15 minutes of prep. Soften 1 chopped onion and 2 "
    "cloves of garlic in 2 tbsp olive oil, add 200 g red lentils, 1 tsp cumin and 1200 ml "
    "vegetable stock, and simmer for 20 minutes. Blend half of it, stir in the juice of 1 "
    "lemon and season. It is vegetarian, and vegan as written.",
    obj(
        name=STR,
        servings=INT,
        prep_minutes=INT,
        cook_minutes=INT,
        ingredients=array(
            obj(item=STR, amount=NUM, unit=enum("g", "ml", "tsp", "tbsp", "piece", "clove"))
        ),
        steps=array(STR),
        vegetarian=BOOL,
        vegan=BOOL,
    ),
    {
        "name": "Lemon lentil soup",
        "servings": 4,
        "prep_minutes": 15,
        "cook_minutes": 20,
        "ingredients": [
            {"item": "onion, chopped", "amount": 1, "unit": "piece"},
            {"item": "garlic", "amount": 2, "unit": "clove"},
            {"item": "olive oil", "amount": 2, "unit": "tbsp"},
            {"item": "red lentils", "amount": 200, "unit": "g"},
            {"item": "ground cumin", "amount": 1, "unit": "tsp"},
            {"item": "vegetable stock", "amount": 1200, "unit": "ml"},
            {"item": "lemon, juiced", "amount": 1, "unit": "piece"},
        ],
        "steps": [
            "Soften the onion and garlic in the olive oil.",
            "Add the lentils, cumin and stock and simmer for 20 minutes.",
            "Blend half of the soup.",
            "Stir in the lemon juice and season.",
        ],
        "vegetarian": True,
        "vegan": True,
    },
)

CODE_REVIEW = Case(
    "code_review",
    "Summarise this code review as a list of findings.",
    "Reviewing the rate limiter PR. In limiter/bucket.py line 42 the refill uses time.time(), "
    "which jumps with NTP adjustments; use time.monotonic(). Line 57 of the same file reads "
    "and writes the token count without the lock, a race under concurrent callers — this must "
    "be fixed before merging. In limiter/config.py line 9, the default burst of 0 disables the "
    "limiter silently; raise a ValueError instead. Otherwise clean; request changes.",
    obj(
        summary=STR,
        findings=array(
            obj(
                file=STR,
                line=INT,
                severity=enum("blocker", "major", "minor", "nit"),
                category=enum("correctness", "concurrency", "api", "testing", "style"),
                message=STR,
            )
        ),
        approve=BOOL,
    ),
    {
        "summary": "Rate limiter PR: a lock race and a wall-clock refill must be fixed.",
        "findings": [
            {
                "file": "limiter/bucket.py",
                "line": 42,
                "severity": "major",
                "category": "correctness",
                "message": "Refill uses time.time(), which jumps with NTP; use time.monotonic().",
            },
            {
                "file": "limiter/bucket.py",
                "line": 57,
                "severity": "blocker",
                "category": "concurrency",
                "message": "Token count is read and written without the lock.",
            },
            {
                "file": "limiter/config.py",
                "line": 9,
                "severity": "major",
                "category": "api",
                "message": "A default burst of 0 silently disables the limiter; raise ValueError.",
            },
        ],
        "approve": False,
    },
)

ITINERARY = Case(
    "itinerary",
    "Extract the booking from this confirmation.",
    "Booking reference QX7P2L for passenger Mateo García Ruiz. Outbound IB3166 from Madrid (MAD) "
    "to Amsterdam (AMS), departing 2024-11-04 07:35 and arriving 10:10, economy. Return KL1701 "
    "from Amsterdam (AMS) to Madrid (MAD), departing 2024-11-08 18:45 and arriving 21:25, "
    "premium economy. One checked bag per passenger and 10 kg of cabin baggage.",
    obj(
        booking_ref=STR,
        passenger=STR,
        segments=array(
            obj(
                flight=STR,
                origin=STR,
                destination=STR,
                departure=STR,
                arrival=STR,
                cabin=enum("economy", "premium_economy", "business", "first"),
            )
        ),
        baggage=obj(checked_bags=INT, cabin_kg=NUM),
    ),
    {
        "booking_ref": "QX7P2L",
        "passenger": "Mateo García Ruiz",
        "segments": [
            {
                "flight": "IB3166",
                "origin": "MAD",
                "destination": "AMS",
                "departure": "2024-11-04 07:35",
                "arrival": "2024-11-04 10:10",
                "cabin": "economy",
            },
            {
                "flight": "KL1701",
                "origin": "AMS",
                "destination": "MAD",
                "departure": "2024-11-08 18:45",
                "arrival": "2024-11-08 21:25",
                "cabin": "premium_economy",
            },
        ],
        "baggage": {"checked_bags": 1, "cabin_kg": 10},
    },
)

CASES: tuple[Case, ...] = (CONTACT, INVOICE, INCIDENT, RECIPE, CODE_REVIEW, ITINERARY)
