"""Sessions: a live stream's whole state as a versioned, checksummed byte string, and back.

| module | what |
|---|---|
| ``format`` | the byte format (header, sections, checksum), capture and restore of a stream's caches |
| ``decoder_rows`` | the attention decoder's K/V rows as a session section (pages written once, shared on load) |

``docs/sessions.md`` describes the format.
"""
