"""Reading TensorBoard event files back in tests, without TensorBoard."""

import struct


def scalar_events(data: bytes) -> list[tuple[int, dict[str, float]]]:
  """(step, scalars) of each scalar event in TFRecord-framed event bytes; whole records only."""
  from tensorboardX.proto import event_pb2

  found, offset = [], 0
  while offset < len(data):
    (length,) = struct.unpack("<Q", data[offset : offset + 8])
    event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
    offset += 12 + length + 4  # Length, its CRC, the record, its CRC.
    if event.HasField("summary"):
      found.append((event.step, {v.tag: v.simple_value for v in event.summary.value}))
  assert offset == len(data)  # Whole records only.
  return found
