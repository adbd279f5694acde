"""The stored responses' table: one row a response, its texts as the client sent and got them.
The ledger keeps no text; this table is the users' data, kept for METERING_RESPONSES_RETENTION_DAYS
(docs/api/responses.md, SECURITY.md)."""

from datetime import datetime

from sqlalchemy import Index, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from metering.db import Base, UTCDateTime


class StoredResponse(Base):
    __tablename__ = "stored_responses"
    __table_args__ = (Index("ix_stored_responses_created_at", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    team_id: Mapped[str] = mapped_column(String(40))
    user_id: Mapped[str] = mapped_column(String(40))
    token_id: Mapped[str | None] = mapped_column(String(40))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    previous_response_id: Mapped[str | None] = mapped_column(String(40))
    model: Mapped[str] = mapped_column(String(256))
    instructions: Mapped[str | None] = mapped_column(Text)
    input_items: Mapped[str] = mapped_column(Text)  # a JSON list, each item with its id
    response: Mapped[str] = mapped_column(Text)  # the Response object, as the client got it
