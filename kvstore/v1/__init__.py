"""Generated protobuf code (tools/genproto.sh); do not edit."""
