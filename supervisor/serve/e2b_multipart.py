"""``multipart/form-data`` uploads (the ``e2b`` SDK's ``files.write`` of bytes and
``write_files``) parsed as they stream in, with python-multipart's push parser (the
parser Starlette uses; a hand-written one would get boundaries split across reads
wrong): each part's file name and its data as an async iterator, in order."""

from __future__ import annotations

from collections.abc import AsyncIterator

from python_multipart.multipart import MultipartParser, parse_options_header

from supervisor.serve.e2b_http import HttpError

MAX_HEADER = 16 << 10


async def parts(content_type: str, body: AsyncIterator[bytes]) -> AsyncIterator[tuple[str, AsyncIterator[bytes]]]:
    """(file name, data) of each part. Consume each part's data before the next part."""
    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        raise HttpError(400, "multipart body without a boundary")
    events: list[tuple[str, bytes]] = []
    field: list[bytes] = [b""]
    header: dict[bytes, bytes] = {}
    ended: list[bool] = []

    def on_header_field(data: bytes, start: int, end: int) -> None:
        field[0] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        name = field[0].lower()
        header[name] = header.get(name, b"") + data[start:end]
        if len(header[name]) > MAX_HEADER:
            raise HttpError(400, "multipart header too long")

    def on_header_end() -> None:
        field[0] = b""

    def on_headers_finished() -> None:
        _, opts = parse_options_header(header.get(b"content-disposition", b""))
        events.append(("begin", opts.get(b"filename", b"")))
        header.clear()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        events.append(("data", bytes(data[start:end])))

    def on_part_end() -> None:
        events.append(("end", b""))

    def on_end() -> None:
        ended.append(True)

    parser = MultipartParser(
        boundary,
        {
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
            "on_end": on_end,
        },
    )

    async def next_events() -> bool:
        """Feed the parser until it has events; False at the end of the body."""
        while not events:
            piece = await anext(body, None)
            if piece is None:
                parser.finalize()
                if not ended:
                    raise HttpError(400, "multipart body ended before its closing boundary")
                return bool(events)
            try:
                parser.write(piece)
            except HttpError:
                raise
            except Exception as exc:  # python-multipart's MultipartParseError and friends
                raise HttpError(400, f"malformed multipart body: {exc}") from None
        return True

    async def data() -> AsyncIterator[bytes]:
        while await next_events():
            kind, value = events.pop(0)
            if kind == "data":
                if value:
                    yield value
            elif kind == "end":
                return
        raise HttpError(400, "multipart body ended inside a part")

    while await next_events():
        kind, value = events.pop(0)
        if kind == "begin":
            yield value.decode("utf-8", "surrogateescape"), data()
