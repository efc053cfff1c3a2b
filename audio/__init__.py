"""Orpheus-style streaming speech: token layout, constrained generation with a loop guard, SNAC 24 kHz decode
while generating, text splitting and audio formats. The engine is :class:`audio.engine.TTSEngine`."""
